"""Inference: model loading, generation requests, preprocessing, the HF fallback and the batcher."""
