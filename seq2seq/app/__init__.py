"""The application layer: what the `seq2seq` commands do, as plain functions over typed options.

`model` opens a translator from paths (a checkpoint, several as an ensemble,
or a CTranslate2 export), `streams` translates records read from a file or
stdin into output lines, `evaluation` decodes and scores a test set, `runs`
prepares a run's data and averages its checkpoints, `distill` makes a
student's data, `recipe` runs a whole recipe as resumable steps with typed
results, `files` holds the guards
that keep an output from destroying an input and `progress` the bar. The
CLI, the server, the scripts and the tests call these; none of them parses
arguments, prints a result or exits. The layer sits above `translate`,
`exported`, `alignment`, `ensemble`, `metrics` and `training`, and below
`cli` and `serve` (docs/architecture.md).
"""
