"""Fine-tuning a recommender LM on the answer tokens: the teacher, or a student trained alone."""
