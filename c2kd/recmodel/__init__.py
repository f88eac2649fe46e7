"""The recommender language model shared by teacher and student."""
