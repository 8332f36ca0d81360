from seq2seq.cli import main

raise SystemExit(main())
