"""Deployment: export a recommender to ONNX, rank with onnxruntime alone, recommend."""
