"""Wrap a `transformers` Llama in tlt-kernels' speculative engine and check greedy identity.

    python examples/hf_integration.py            # CPU, a few seconds; CUDA used when available

Builds a small random-weight transformers LlamaForCausalLM (no download), loads its state dict into
`tlt_kernels.models.LlamaForCausalLM.from_hf`, generates with the n-gram drafter and the adaptive
selector, and compares with transformers' own greedy `generate`.
"""
import torch

from tlt_kernels.engine import SpeculativeEngine
from tlt_kernels.models import LlamaForCausalLM
from tlt_kernels.runtime import GraphPool, Strategy, StrategySelector


def main():
    try:
        import transformers
    except ImportError:
        raise SystemExit("this example needs `pip install transformers`")
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf_cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval().to(dev)
    target = LlamaForCausalLM.from_hf(hf_cfg.to_dict(), hf.state_dict(), device=dev, dtype=torch.float32)

    # Repetitive prompts so n-gram drafts get accepted.
    prompts = torch.tensor([list(b"abcabcabcabc"), list(b"x = 1; x = 1")], device=dev)
    sel = StrategySelector([Strategy(2, 1, 3), Strategy(4, 1, 5)], seed=0)
    pool = GraphPool() if dev == "cuda" else None
    eng = SpeculativeEngine(target, "ngram", sel, pool, max_batch_size=2, max_seq_len=64, backend="torch", progress=True)
    if pool is not None:
        eng.capture_graphs([1, 2])
    out = eng.generate(prompts, [24, 12])

    all_same = True
    for b, n in enumerate([24, 12]):
        hf_out = hf.generate(prompts[b : b + 1], max_new_tokens=n, do_sample=False, pad_token_id=0)[0, prompts.shape[1]:]
        same = hf_out.tolist() == out.tokens[b]
        all_same &= same
        print(f"request {b}: {n} tokens, identical to transformers greedy: {same}")
    print(f"steps {len(out.steps)}, mean accepted length {out.mean_accepted_length():.2f}, "
          f"strategies by batch size {out.strategies_by_batch()}")
    if not all_same:
        raise SystemExit("greedy output differs from transformers' own generate")


if __name__ == "__main__":
    main()
