"""The tiny DFlash drafter shape the drafter tests share: GQA (4 heads over 2), 2 layers, block 5, reading
target layers 0 and 2 of a 3-layer target with a 64-token vocabulary."""

from kdtree_engine.drafter import DFlashConfig

CFG = DFlashConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    block_size=5,
    target_layer_ids=(0, 2),
    mask_token_id=63,
    num_target_layers=3,
    rope_theta=10_000.0,
)
