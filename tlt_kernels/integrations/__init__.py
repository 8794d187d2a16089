"""Our kernels in the call shapes of the engines that exist: one module per engine.

Each entry point takes that engine's tensors as its own kernels receive them and returns outputs in its layout, on
the device, without host synchronization, so it can sit inside a captured step:

* :mod:`tlt_kernels.integrations.flashinfer`: ``chain_speculative_sampling`` (draft probabilities, draft ids,
  target probabilities) -> output tokens and the two counters;
* :mod:`tlt_kernels.integrations.sglang`: ``verify_tree_greedy`` and ``tree_speculative_sampling_target_only``
  (EAGLE trees as retrieval index plus first-child / next-sibling links) -> predicts, accept_index,
  accept_token_num; ``build_tree_outputs`` / ``retrieval_arrays`` (our trees in its tree builder's layout);
* :mod:`tlt_kernels.integrations.vllm`: ``rejection_sample`` (vLLM v1's flattened drafts with cumulative counts,
  draft probabilities or none, target logits, bonus tokens, per-request sampling parameters) -> its output layout.
* :mod:`tlt_kernels.integrations.transformers`: ``speculative_generate(model, input_ids, ...)`` in place of a
  ``transformers`` model's ``generate`` (our engine underneath), and ``SpeculativeGenerator`` for loops.

Every adapter keeps the lossless rule; where an engine offers a lossy one, its docstring says so. docs/INTEGRATION.md
shows where each call goes in that engine's verification step.
"""
