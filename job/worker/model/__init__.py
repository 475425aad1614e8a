"""The model: the causal LM and its loss (`causal_lm`), LoRA (`lora`), sharding (`parallelize`), the chunked loss
(`loss`) and the checked export (`export`)."""
