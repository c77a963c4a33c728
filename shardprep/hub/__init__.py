"""The Hugging Face Hub: the client's edges, publish, fetch into the stage-sharded cache,
and the model card."""
