"""8B-class (and the real small models') shapes by their published configs: enough to build a model
with random weights for speed, in atskv (`atskv.eval.speed`) or in vLLM (`atskv.eval.vllm_speed`,
whose processes must not import transformers). Plain data."""

# published configs (config.json of the named checkpoints), enough to build the shape
SHAPES: dict[str, dict] = {
    "llama3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "qwen3-8b": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32768, max_position_embeddings=131072, rope_theta=1000000.0,
        sliding_window=None, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    # the two real models' shapes (their published configs), for speed without staging the weights
    "smollm2-135m-shape": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "gemma3-270m-shape": dict(
        model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512, rope_theta=1000000.0,
        query_pre_attn_scalar=256, max_position_embeddings=32768, tie_word_embeddings=True,
    ),
}  # fmt: skip
