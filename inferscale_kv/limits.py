"""Limits the memory service and the inference nodes share, each declared once here: the service's option defaults
are these constants, and the node holds its requests to them."""

# The longest query the memory service searches (its --max-query-chars default): a node sends at most this much of a
# request's question (a longer one is searched by its beginning).
MAX_QUERY_CHARS = 2000
# The largest top_k one search may ask the memory service for (its --max-top-k default; a FetchKv's facts too).
MAX_SEARCH_TOP_K = 1000
# The largest memory.top_k (and memory.recompute_tail_facts) a request to a node may give: a node's own cap on the
# facts it puts before one prompt, below MAX_SEARCH_TOP_K so that a memory service at its defaults never refuses it.
MAX_MEMORY_TOP_K = 200
# Hybrid retrieval fuses at least this many of each ranking's best facts (more only for a larger top_k): a node asking
# for a warm-up beyond a request's top_k stays within it, so that the request's own facts rank as they would alone.
HYBRID_CANDIDATES = 100

# The most RetrieveAndStage calls one RetrieveAndStageBatch carries (a node's micro-batch of concurrent queries), and
# the most facts (top_k summed over them) a node asks in one: its answer stays well under MAX_MESSAGE_BYTES.
MAX_RETRIEVE_BATCH = 256
MAX_BATCH_FACTS = 2048
# The largest gRPC message the memory service accepts or sends (its --max-message-bytes default), and a node takes.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
