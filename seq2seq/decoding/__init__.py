"""Ids to translations: search (greedy, beam, sampling) over a model's decoding session (`search`),
ensembles (`ensemble`), the cache-less reference (`uncached`), the translators (`translate`), alignments
(`alignment`) and attention pictures (`pictures`)."""
