"""``llmrt serve``: an OpenAI-compatible HTTP server over one continuous-batching engine."""
