"""Hugging Face transformers on sdpa_numba: one call, then attn_implementation="sdpa_numba".

Run: python docs/examples/transformers_quickstart.py   (the tests run it too; it needs
transformers and torch: pip install "sdpa_numba[transformers]")
"""

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import sdpa_numba.integrations.transformers as sdpa_numba_hf

sdpa_numba_hf.register()  # once per process: adds "sdpa_numba" to transformers

# A small Llama with grouped-query attention (8 query heads on 2 key/value heads) and random
# weights; from_pretrained(..., attn_implementation="sdpa_numba") works the same way.
config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                     initializer_range=0.2, pad_token_id=0)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                         attn_implementation="sdpa_numba").eval()

# Two prompts of different lengths, left-padded, then greedy generation with the KV cache.
ids = torch.tensor([[0, 0, 0, 5, 17, 42, 9], [3, 8, 61, 2, 99, 14, 7]])
mask = (ids != 0).long()
new = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                     pad_token_id=0)

# The same weights on torch's SDPA generate the same tokens. (Each model gets its own copy
# of the config: from_config writes the implementation's name into the config it is given.)
reference = AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                             attn_implementation="sdpa").eval()
reference.load_state_dict(model.state_dict())
assert torch.equal(new, reference.generate(ids, attention_mask=mask, max_new_tokens=10,
                                           do_sample=False, pad_token_id=0))

# Training: gradients flow through sdpa_numba's backward kernels.
model.train()
loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
loss.backward()
assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0

print("transformers_quickstart: generation matches torch's SDPA; gradients flow")
