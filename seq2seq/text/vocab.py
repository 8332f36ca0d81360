"""The special token ids, fixed for every vocabulary: the tokenizer assigns them, the model and search rely on them."""

PAD = 0
UNK = 1
BOS = 2
EOS = 3
