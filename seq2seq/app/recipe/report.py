"""results.md: the recipe's typed results as Markdown tables."""

from __future__ import annotations

from seq2seq.app.recipe.results import Member, RecipeResults, StudentResult, TestResult, TestScore, TrainResult

HEADER = (
    "| pair | params | updates | full epochs | train min | checkpoint (picked on val) | val BLEU | test sacreBLEU "
    "| test lc tok BLEU | test chrF |"
)


def markdown(results: RecipeResults) -> str:
    lines = [
        HEADER,
        "|---|---|---|---|---|---|---|---|---|---|",
        *system_rows(results),
        "",
        *teacher_lines(results),
        "Test BLEU ± the half-width of its 95% interval over 1,000 resampled test sets (sacreBLEU's bootstrap).",
        "",
        "| candidate | val sacreBLEU |",
        "|---|---|",
        *(f"| {name} | {bleu} |" for name, bleu in candidates(results).items()),
        "",
        "| source | reference | ours |",
        "|---|---|---|",
        *(
            "| " + " | ".join(text.replace("|", "\\|") for text in (e.source, e.reference, e.ours)) + " |"
            for e in results.test.examples
        ),
    ]
    if results.student is not None:
        lines += ["", *student_rows(results, results.student)]
    return "\n".join(lines) + "\n"


def teacher_lines(results: RecipeResults) -> list[str]:
    """With --teacher, what the system is: that config's model, not one of the recipe's own."""
    if not results.teacher:
        return []
    config, *settings = results.teacher
    given = f" with {' '.join(settings)}" if settings else ""
    run_dir = results.members[0].train.run_dir
    return [f"The system is the model of {config}{given} (trained in {run_dir}), picked on this pair's val.", ""]


def system_rows(results: RecipeResults) -> list[str]:
    """A row for the recipe's model; with seeds, one for each member (val only) and one for the ensemble."""
    pair, test = results.pair, results.test.score
    if not results.ensemble:
        member = results.members[0]
        return [_row(pair, member.train, member.train.epochs, member.pick.picked, _val(member), test)]
    rows = [
        _row(f"{pair}, seed {seed}", m.train, m.train.epochs, m.pick.picked, _val(m), None)
        for seed, m in zip(results.seeds, results.members)
    ]
    picked = " + ".join(f"{m.name}/{m.pick.picked}" for m in results.members)
    members = [m.train for m in results.members]
    total = TrainResult(
        "",
        round(sum(t.params_millions for t in members), 1),
        sum(t.updates for t in members),
        0,
        round(sum(t.train_minutes for t in members), 1),
    )
    label = f"{pair}, ensemble of {len(rows)}"
    return [*rows, _row(label, total, "-", picked, results.system.val["ensemble"], test)]


def _val(member: Member) -> float:
    return member.pick.val[member.pick.picked]


def _row(label: str, t: TrainResult, epochs: int | str, picked: str, val_bleu: float, test: TestScore | None) -> str:
    return (
        f"| {label} | {t.params_millions}M | {t.updates} | {epochs} | {t.train_minutes} | {picked} "
        f"| {val_bleu} | {_bleu(test)} | {_tokenized(test)} | {test.chrf if test else '-'} |"
    )


def candidates(results: RecipeResults) -> dict[str, float]:
    """Every candidate's val BLEU, the members' named by their seed, and the ensemble's."""
    if not results.ensemble:
        return results.members[0].pick.val
    named = {f"{m.name}/{name}": bleu for m in results.members for name, bleu in m.pick.val.items()}
    return {**named, **results.system.val}


def student_rows(results: RecipeResults, student: StudentResult) -> list[str]:
    """The student beside its teacher: val, test and test decoding speed."""
    teacher = results.system.picked
    data = "distilled + original" if student.mix else "distilled"
    params = sum(m.train.params_millions for m in results.members)
    rows = [
        "| system | params | train min | val BLEU | test sacreBLEU | test lc tok BLEU | test chrF | test sentences/s |",
        "|---|---|---|---|---|---|---|---|",
        _speed_row(
            f"teacher ({teacher})",
            round(params, 1),
            round(sum(m.train.train_minutes for m in results.members), 1),
            results.system.val[teacher],
            results.test,
        ),
        _speed_row(
            f"student on {data} ({student.member.pick.picked})",
            student.member.train.params_millions,
            student.member.train.train_minutes,
            _val(student.member),
            student.test,
        ),
    ]
    int8 = student.int8
    if int8.test is None:
        return [*rows, "", f"Student in CTranslate2 int8: skipped ({int8.skipped})."]
    rows.append(_speed_row("student, CTranslate2 int8", student.member.train.params_millions, "-", "-", int8.test))
    speed = f"Speed: {results.test_set} decoded with {results.threads} thread(s), tokenization included."
    return [*rows, "", speed]


def _speed_row(label: str, params: float, minutes: float | str, val_bleu: float | str, test: TestResult) -> str:
    s = test.score
    return (
        f"| {label} | {params}M | {minutes} | {val_bleu} | {_bleu(s)} | {_tokenized(s)} | {s.chrf} "
        f"| {test.sentences_per_second} |"
    )


def _bleu(score: TestScore | None) -> str:
    return "-" if score is None else f"{score.sacrebleu} ± {score.sacrebleu_ci95}"


def _tokenized(score: TestScore | None) -> str:
    if score is None or score.tok_lc_bleu is None:
        return "-"
    return f"{score.tok_lc_bleu} ± {score.tok_lc_bleu_ci95}"
