"""What a run keeps on disk: checkpoints (`checkpoint`, loaded safely: `security`), the run directory
(`run_dir`) and what the framework may delete (`owned`)."""
