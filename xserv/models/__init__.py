"""Model configs, checkpoints and forwards: registry.py maps Hugging Face architectures to them (docs/models.md)."""
