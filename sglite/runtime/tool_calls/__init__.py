"""Tool calls: parsing a model's call text into OpenAI `tool_calls` (whole or streamed), and the
grammars that make a required or named call always parse (`formats.py` lists the formats)."""
