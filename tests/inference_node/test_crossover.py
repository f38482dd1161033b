"""The kv crossover table: a measured shape is found under the node's key, an unmeasured one is not."""

from transformers import LlamaConfig

from inference_node.crossover import measured_crossover, shape_key


def test_a_measured_shape_has_its_crossover_and_others_have_none() -> None:
    smollm2 = LlamaConfig(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                          num_key_value_heads=3)
    assert shape_key(smollm2, "float32", "cpu") == "llama-30L-576h-1536ff-3kv:float32:cpu"
    assert measured_crossover(shape_key(smollm2, "float32", "cpu")) == 0
    assert measured_crossover(shape_key(smollm2, "bfloat16", "NVIDIA H200")) is None
