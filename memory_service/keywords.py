"""BM25 over one user's facts (bm25s, Lucene's variant): the keyword ranking's scores and ranks depend only on that
user's facts, never on other users' (whose word frequencies a store-wide index would disclose through the scores, and
let sway the weights) nor on the order of rows in the store.

Words: lower-cased runs of letters and digits, English stop words out, each reduced to its Snowball (Porter 2)
English stem, so that "hiking" in a query finds "hike" in a fact."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

# Where JAX is installed, importing bm25s imports it and runs a top-k with it; on a GPU host JAX then takes 75% of the
# GPU's memory (its default preallocation), leaving the vLLM node beside the service too little to start. The scores
# here never use JAX's top-k: keep JAX, if present, on the CPU unless the operator chose otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import bm25s
import numpy as np
import Stemmer

_K1 = 1.2  # Lucene's defaults, as LanceDB's full-text index had them
_B = 0.75
_WORD = r"(?u)\b\w+\b"
_STEMMERS = threading.local()  # a PyStemmer stemmer is not thread-safe: one per thread


def _stemmer() -> Stemmer.Stemmer:
    stemmer: Stemmer.Stemmer | None = getattr(_STEMMERS, "english", None)
    if stemmer is None:
        # No word cache: it would keep up to 10,000 of any user's words per thread, outside the search cache's budget.
        stemmer = _STEMMERS.english = Stemmer.Stemmer("english", 0)
    return stemmer


def words(texts: Sequence[str]) -> list[list[str]]:
    """Each text's indexed words (stems), in order."""
    tokenized: list[list[str]] = bm25s.tokenize(list(texts), lower=True, stopwords="en", token_pattern=_WORD,
                                                stemmer=_stemmer(), return_ids=False, show_progress=False)
    return tokenized


class KeywordIndex:
    """BM25 of queries against a fixed list of texts (one user's facts), built once; read-only after."""

    def __init__(self, texts: Sequence[str]) -> None:
        corpus = words(texts)
        self._size = len(corpus)
        self._bm25: bm25s.BM25 | None = None
        if any(corpus):  # bm25s cannot index a corpus without a word
            self._bm25 = bm25s.BM25(method="lucene", k1=_K1, b=_B)
            self._bm25.index(corpus, show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """float32 BM25 score of every text against the query's words, in the texts' order; 0 where a text shares no
        word with the query."""
        query_words = words([query])[0]
        if self._bm25 is None or not any(word in self._bm25.vocab_dict for word in query_words):
            return np.zeros(self._size, dtype=np.float32)
        scores: np.ndarray = self._bm25.get_scores(query_words)
        return scores
