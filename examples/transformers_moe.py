"""scatter_add.moe as the experts implementation of a transformers model.

Builds a small MixtralForCausalLM from a config (random weights, no download, float32), registers
the kernel's experts function with transformers, then generates greedily with
experts_implementation="scatter_add" and with transformers' "eager" loop: prints both token
sequences (they are the same) and the tokens per second of each. (In bf16 the two can part ways
after a while: ours sums each token's expert rows in float32 and rounds once, eager rounds each
row to bf16 first, and with random weights near-ties in the argmax are common.)

Run it (after `make hub`):  .venv/bin/python examples/transformers_moe.py
With a real checkpoint the same two calls apply:

    sa.moe.register()
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="scatter_add")
"""
import copy
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, MixtralConfig


def load_kernel():
    import kernels

    return kernels.get_local_kernel(Path(__file__).resolve().parents[1])


def main():
    sa = load_kernel()
    name = sa.moe.register()  # "scatter_add"

    config = MixtralConfig(vocab_size=1000, hidden_size=256, intermediate_size=896, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=name).eval()
    with torch.no_grad():  # wider random weights than the default init, so that the text varies
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    eager = copy.deepcopy(model)
    eager.set_experts_implementation("eager")  # the model's own loop, same weights
    models = {name: model, "eager": eager}

    prompt = torch.randint(1, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    new_tokens = 48
    outputs, rates = {}, {}
    for impl, model in models.items():
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        outputs[impl] = model.generate(prompt, **kw)
        rates[impl] = prompt.shape[0] * new_tokens / (time.perf_counter() - t0)

    for impl, out in outputs.items():
        print(f"{impl:>12}: {out[0, prompt.shape[1]:].tolist()[:16]} ... {rates[impl]:7.1f} tokens/s")
    same = torch.equal(outputs[name], outputs["eager"])
    print(f"same tokens: {same}")
    if not same:
        raise SystemExit("the two implementations generated different tokens")


if __name__ == "__main__":
    main()
