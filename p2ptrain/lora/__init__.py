"""LoRA mode: frozen base directories (basefile.py); the model is models/lora.py."""
