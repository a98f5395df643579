"""The OpenAI-compatible HTTP server (`xserv serve`)."""
