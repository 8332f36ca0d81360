"use strict";
// The attention explorer. It uses the server's public JSON API only: GET info (the models served and
// their decode settings), POST translate with "attention": true (every layer and head, each hypothesis).
// Means of heads, the heatmap and the links are drawn here; the numbers all come from the server.

(function () {
  const WORD_START = "\u2581"; // SentencePiece's mark of a piece that begins a word
  const EOS = "</s>";
  let info = null;

  const $ = (id) => document.getElementById(id);

  function element(tag, attributes, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attributes || {})) node.setAttribute(key, value);
    node.append(...children);
    return node;
  }

  function svgElement(tag, attributes) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [key, value] of Object.entries(attributes || {})) node.setAttribute(key, value);
    return node;
  }

  function setStatus(text, isError) {
    $("status").textContent = text;
    $("status").className = isError ? "error" : "";
  }

  async function call(path, body) {
    const request = body === undefined ? {} : { method: "POST", body: JSON.stringify(body) };
    const response = await fetch(path, request);
    const answer = await response.json();
    if (!response.ok) throw new Error(answer.error || response.statusText);
    return answer;
  }

  function colour(weight) {
    return `hsl(220, 75%, ${Math.round(100 - 62 * Math.min(1, Math.max(0, weight)))}%)`;
  }

  // One layer's weights (T x S) for a head, or the mean of the heads.
  function matrix(map, layer, head) {
    const heads = map.weights[layer];
    if (head !== "mean") return heads[Number(head)];
    return heads[0].map((row, t) => row.map((_, s) => heads.reduce((sum, h) => sum + h[t][s], 0) / heads.length));
  }

  function shown(piece) {
    return piece.startsWith(WORD_START) ? piece.slice(1) : piece;
  }

  // The whitespace words of EOS-ended pieces, as the server counts them for word alignments.
  function words(pieces) {
    const out = [];
    for (const piece of pieces.slice(0, -1)) {
      if (piece.startsWith(WORD_START) || out.length === 0) out.push(shown(piece));
      else out[out.length - 1] += piece;
    }
    return out;
  }

  function heatmap(map, weights) {
    const head = element("tr", {}, element("th"));
    const sources = map.source.map((piece) => element("th", { scope: "col" }, shown(piece)));
    head.append(...sources);
    const rows = map.target.map((piece, t) => {
      const cells = weights[t].map((w, s) =>
        element("td", {
          "data-weight": w.toFixed(4),
          title: `${shown(piece)} \u2192 ${shown(map.source[s])}: ${w.toFixed(3)}`,
          style: `background: ${colour(w)}`,
        }),
      );
      const row = element("tr", {}, element("th", { scope: "row" }, shown(piece)), ...cells);
      row.addEventListener("mouseenter", () => light(row, sources, weights[t]));
      row.addEventListener("mouseleave", () => light(row, sources, null));
      return row;
    });
    return element("table", { class: "heatmap" }, element("thead", {}, head), element("tbody", {}, ...rows));
  }

  // Hovering a target subword: its row marked, its source subwords shaded by how much it attends to them.
  function light(row, sources, weights) {
    row.classList.toggle("hovered", weights !== null);
    sources.forEach((th, s) => {
      th.classList.toggle("lit", weights !== null && weights[s] >= 0.1);
      th.style.background = weights === null ? "" : colour(weights[s]);
      th.style.color = weights !== null && weights[s] > 0.5 ? "#fff" : "";
    });
  }

  function links(map) {
    const source = words(map.source);
    const target = words(map.target);
    const svg = svgElement("svg", { class: "links", height: "80" });
    const place = (list, y) =>
      list.map((word) => {
        const text = svgElement("text", { y: String(y) });
        text.textContent = word;
        svg.append(text);
        return text;
      });
    const top = place(source, 14);
    const bottom = place(target, 74);
    return { svg, draw: () => drawLinks(svg, top, bottom, map.word_alignment) };
  }

  // Once in the page (text widths are known only there): words spread out, a line per aligned pair.
  function drawLinks(svg, top, bottom, alignment) {
    const centres = (texts) => {
      let x = 0;
      return texts.map((text) => {
        const width = text.getComputedTextLength() || 8 * text.textContent.length;
        text.setAttribute("x", String(x));
        x += width + 14;
        return x - 14 - width / 2;
      });
    };
    const above = centres(top);
    const below = centres(bottom);
    const width = Math.max(...above, ...below, 0) + 60;
    svg.setAttribute("width", String(width));
    for (const pair of alignment.split(" ").filter(Boolean)) {
      const [i, j] = pair.split("-").map(Number);
      const line = svgElement("line", { x1: above[i], y1: "19", x2: below[j], y2: "60" });
      line.dataset.pair = pair;
      svg.append(line);
    }
  }

  function option(value, label, selected) {
    const node = element("option", { value: String(value) }, label);
    node.selected = selected;
    return node;
  }

  // The heatmap of one hypothesis, with its layer and head selectors (the last layer, heads averaged, first).
  function attentionView(map) {
    const layer = element("select", { class: "layer-select", "aria-label": "layer" });
    layer.append(...map.layers.map((name, i) => option(i, name, i === map.layers.length - 1)));
    const head = element("select", { class: "head-select", "aria-label": "head" });
    head.append(option("mean", "mean of heads", true), ...map.heads.map((name, i) => option(i, name, false)));
    const holder = element("div", { class: "heatmap-holder" });
    const redraw = () => holder.replaceChildren(heatmap(map, matrix(map, Number(layer.value), head.value)));
    layer.addEventListener("change", redraw);
    head.addEventListener("change", redraw);
    redraw();
    const controls = element("div", { class: "controls" }, element("label", {}, "layer ", layer));
    controls.append(element("label", {}, "head ", head));
    const drawn = links(map);
    const caption = "word alignment: each target subword linked to the source word it attends to most, "
      + "all layers and heads averaged (seq2seq translate --alignment --attention-layer all)";
    const view = element("div", { class: "attention" }, controls, holder, drawn.svg);
    view.append(element("p", { class: "caption" }, caption));
    return { view, draw: drawn.draw };
  }

  function about(describe) {
    const parts = [describe.engine, describe.device];
    if (describe.parameters) parts.push(`${describe.parameters.toLocaleString("en")} parameters`);
    if (describe.source_language) parts.push(`${describe.source_language} \u2192 ${describe.target_language}`);
    return parts.filter(Boolean).join(", ");
  }

  function modelSection(name, answer) {
    const section = element("section", { class: "model", "data-model": name });
    section.append(element("h2", {}, name), element("p", { class: "about" }, about(info.models[name])));
    if (answer.error) {
      section.append(element("p", { class: "error" }, answer.error));
      return section;
    }
    const result = answer.translations[0];
    const hypotheses = result.nbest || [{ text: result.text, score: result.score }];
    const list = element("ol", { class: "hypotheses" });
    const view = element("div", { class: "view" });
    const items = hypotheses.map((h, k) => {
      const score = h.score === null || h.score === undefined ? "" : h.score.toFixed(3);
      const item = element("li", {}, element("span", { class: "text" }, h.text), element("span", { class: "score" }, score));
      item.addEventListener("click", () => choose(k));
      return item;
    });
    list.append(...items);
    section.append(list);
    if (answer.note) section.append(element("p", { class: "note" }, answer.note));
    section.append(view);
    const choose = (k) => {
      items.forEach((item, i) => item.classList.toggle("chosen", i === k));
      const map = result.attention && result.attention[k];
      if (!map) return view.replaceChildren();
      const shown = attentionView(map);
      view.replaceChildren(shown.view);
      shown.draw();
    };
    section.choose = choose;
    return section;
  }

  function decodeOptions() {
    const strategy = $("strategy").value;
    const options = { strategy, nbest: Number($("nbest").value), scores: true };
    if (strategy === "beam") options.beam_size = Number($("beam-size").value);
    return { ...options, attention: true, attention_layer: "all", attention_heads: "each" };
  }

  async function translate() {
    const text = $("text").value.trim();
    if (!text) return setStatus("Type a sentence first.", true);
    setStatus("translating\u2026");
    $("translate").disabled = true;
    const options = decodeOptions();
    const names = Object.keys(info.models);
    const answers = await Promise.all(
      names.map((model) => call("translate", { text: [text], model, options }).catch((e) => ({ error: e.message }))),
    );
    const sections = names.map((name, i) => modelSection(name, answers[i]));
    $("models").replaceChildren(...sections);
    sections.forEach((section) => section.choose && section.choose(0));
    $("translate").disabled = false;
    setStatus(answers.every((a) => a.error) ? "no model could translate it" : "", answers.every((a) => a.error));
  }

  async function start() {
    try {
      info = await call("info");
    } catch (e) {
      return setStatus(`the server did not answer: ${e.message}`, true);
    }
    const names = Object.keys(info.models);
    const side = names.length > 1 ? `, side by side: ${names.join(", ")}` : "";
    $("models-info").textContent = `seq2seq ${info.version}${side}`;
    const decode = info.models[names[0]].decode;
    $("strategy").value = decode.strategy === "greedy" ? "greedy" : "beam";
    $("beam-size").value = decode.beam_size;
    $("beam-size").max = info.limits.max_beam;
    $("nbest").value = decode.nbest;
    $("ask").addEventListener("submit", (event) => {
      event.preventDefault();
      translate();
    });
    $("translate").disabled = false;
    document.body.dataset.ready = "true";
  }

  $("translate").disabled = true;
  start();
})();
