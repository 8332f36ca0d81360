import sys

if __name__ == "__main__":  # not when a worker process imports it
    try:
        from seq2seq.entry import main
    except KeyboardInterrupt:  # a Ctrl-C while the entry point itself loads: seq2seq.entry catches them from there on
        print("seq2seq: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    raise SystemExit(main())
