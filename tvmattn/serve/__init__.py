"""Serving: a continuous-batching engine over the paged KV cache (`engine`), its model runner
(`runner`), prefix caching (`prefix`), incremental text with stop strings (`text`), JSON-constrained
sampling (`grammar`), and the OpenAI-compatible HTTP server (`server`) with its command line (`cli`)."""
