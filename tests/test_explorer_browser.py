"""The explorer in a real browser: headless Chromium (Debian's chromium and chromium-driver, which
scripts/setup.sh installs when it runs as root) driven by Selenium, against `seq2seq serve` with two models
side by side. Skipped, saying so, where there is no Chromium.

Every wait is on a condition of the page, with room for a busy machine; nothing sleeps. With
SEQ2SEQ_SCREENSHOT=PATH the test also saves its screenshot there (docs/explorer.png comes from it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY, tiny_overrides

from seq2seq.cli import main

BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser") if shutil.which(name)), None)
DRIVER = shutil.which("chromedriver")
if BROWSER is None or DRIVER is None:
    pytest.skip("no Chromium (apt-get install chromium chromium-driver)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="no Selenium: pip install -e '.[dev]'")
pytest.importorskip("starlette", reason="seq2seq serve needs the serve extra: pip install -e '.[serve]'")

from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402  (after the skips)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402
from test_serve import Server  # noqa: E402

WAIT = 120.0  # seconds for a condition of the page: a translation on two busy cores, a cold browser


@pytest.fixture(scope="module")
def rnn_checkpoint(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small RNN with MLP attention, trained briefly: the lectures' other model, beside the Transformer."""
    run_dir = tmp_path_factory.mktemp("runs") / "rnn"
    rnn = ["model.arch=rnn", "model.transformer=null", "model.rnn.attention=mlp", "model.rnn.hidden_size=32"]
    extra = ("train.max_steps=30", "train.threads=1", "train.precision=fp32", "validation.bleu=false", *rnn)
    assert main(["train", "--config", str(TINY), *tiny_overrides(corpus, run_dir, *extra)]) == 0
    return run_dir / "checkpoint_best.pt"


@pytest.fixture(scope="module")
def server(trained_run: Path, rnn_checkpoint: Path) -> Iterator[Server]:
    transformer = trained_run / "checkpoint_best.pt"
    running = Server(transformer, "--compare", "-c", str(rnn_checkpoint))
    yield running
    assert running.stop() == 143, running.lines  # SIGTERM's code, after the drain


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1400,820")
    driver = webdriver.Chrome(service=webdriver.ChromeService(DRIVER), options=options)
    driver.set_page_load_timeout(WAIT)
    yield driver
    driver.quit()


def cells(section: Any) -> list[str]:
    return [td.get_attribute("data-weight") for td in section.find_elements(By.CSS_SELECTOR, "table.heatmap td")]


def word_of(piece: str) -> str:
    return piece.removeprefix("\u2581")


def test_translate_then_switch_layer_and_head(server: Server, browser: Any, tmp_path: Path) -> None:
    """The page draws what the server answers for the page's request, whatever the trained model translates."""
    options = {"attention": True, "attention_layer": "all", "attention_heads": "each"}
    status, answer = server.post({"text": ["red cat dog sun"], "options": options})
    assert status == 200, answer
    [expected] = answer["translations"][0]["attention"]
    assert len(expected["source"]) == 5 and expected["layers"] == ["layer 1", "layer 2"]  # ▁red ▁cat ▁dog ▁sun </s>
    heads = expected["weights"][-1]  # the last layer, heads averaged as the page averages them
    first_row = [sum(h[0][s] for h in heads) / len(heads) for s in range(len(expected["source"]))]
    wait = WebDriverWait(browser, WAIT)
    browser.get(server.url + "/")
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
    browser.find_element(By.ID, "text").send_keys("red cat dog sun")
    browser.find_element(By.ID, "translate").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "section.model table.heatmap")) == 2)
    transformer, rnn = browser.find_elements(By.CSS_SELECTOR, "section.model")
    assert [transformer.get_attribute("data-model"), rnn.get_attribute("data-model")] == ["tiny", "rnn"]
    assert transformer.find_element(By.CSS_SELECTOR, ".hypotheses .text").text == answer["translations"][0]["text"]
    size = len(expected["target"]) * len(expected["source"])
    assert len(cells(transformer)) == size

    layer = Select(transformer.find_element(By.CSS_SELECTOR, ".layer-select"))
    head = Select(transformer.find_element(By.CSS_SELECTOR, ".head-select"))
    assert layer.first_selected_option.text == "layer 2" and head.first_selected_option.text == "mean of heads"
    shown = cells(transformer)
    layer.select_by_visible_text("layer 1")
    wait.until(lambda d: cells(transformer) != shown)
    shown = cells(transformer)
    head.select_by_visible_text("head 2")
    wait.until(lambda d: cells(transformer) != shown)
    assert len(cells(transformer)) == size

    pairs = expected["word_alignment"].split()
    assert len(transformer.find_elements(By.CSS_SELECTOR, "svg.links line")) == len(pairs)  # a line per aligned pair
    assert len(Select(rnn.find_element(By.CSS_SELECTOR, ".layer-select")).options) == 1  # the RNN's one attention

    layer.select_by_visible_text("layer 2")
    head.select_by_visible_text("mean of heads")
    wait.until(lambda d: cells(transformer) != shown)
    rows = transformer.find_elements(By.CSS_SELECTOR, "table.heatmap tbody th")
    ActionChains(browser).move_to_element(rows[0]).perform()  # the first target subword: what it attends to is lit
    lit = "table.heatmap thead th.lit"
    looked_at = [word_of(piece) for piece, w in zip(expected["source"], first_row) if w >= 0.1]
    assert looked_at, first_row  # weights sum to 1 over five source subwords: one at least is 0.2 or more
    wait.until(lambda d: [th.text for th in transformer.find_elements(By.CSS_SELECTOR, lit)] == looked_at)
    browser.save_screenshot(str(tmp_path / "explorer.png"))
    if os.environ.get("SEQ2SEQ_SCREENSHOT"):
        browser.save_screenshot(os.environ["SEQ2SEQ_SCREENSHOT"])
