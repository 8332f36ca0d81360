from seq2seq.entry import main

if __name__ == "__main__":  # not when a worker process imports it
    raise SystemExit(main())
