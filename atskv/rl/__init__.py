"""Policy-gradient fine-tuning of the relevance predictor (`atskv finetune`): `policy` (Bernoulli
and Gumbel top-k retention over the predictor's logits), `items` (contexts with continuations),
`rollout` (sampled retentions run through the base model), `reward`, `training` (REINFORCE in
Lightning) and `evaluate` (held-out comparison with the supervised predictor and the baselines)."""
