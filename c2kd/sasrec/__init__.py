"""SASRec: the sequential baseline, and the item embeddings the recommender LM's prompts carry."""
