"""Images in prompts (LLaVA-style models): reading and checking images, turning them into prompt
tokens (`processor.py`, in the process that tokenizes), and into the language model's input
embeddings at those tokens (`vision_encoder.py`, in the scheduler process)."""
