"""The jobs `TokenizerManager` (tokenizer_manager.py) coordinates for each request, one a module.

- `request.py`: `GenerateRequest`, one prompt's generation as the scheduler will get it.
- `prompts.py`: `PromptBuilder`, text / ids / images / segment spans into a prompt's token ids.
- `validation.py`: `RequestLimits`, the checks a request passes before it is queued.
- `expansion.py`: batch arguments split per prompt, `n > 1` split into one request per choice.
- `results.py`: `ResultBuilder`, scheduler increments accumulated into SGLang-shaped results.
- `embeddings.py`: what makes a request an embedding request, and its result's shape.
"""
