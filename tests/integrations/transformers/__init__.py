"""transformers: models, generate and contrastive models."""
