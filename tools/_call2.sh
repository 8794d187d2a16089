bash tools/device_install.sh $OUT/install.log
python3 -m tools.hoist_tree_ab --reps 30 --out $OUT/hoist.json > $OUT/hoist.log 2>&1; tail -1 $OUT/hoist.log
(python3 -m tools.profile_rollout --random-smollm2 --drafters eagle,ngram --arm s2k1v3 --batches 1,32 --tokens 96 --no-detail > $OUT/prof.log 2>&1; grep "^## " $OUT/prof.log)
cd /work/main 2>/dev/null || true
pip install -q --no-index --no-deps --target /tmp/site .peer/whl/*.whl > /dev/null 2>&1
PYTHONPATH=/tmp/site timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/ops/test_tree_attention.py tests/ops/test_tree_attention_edge_cases.py tests/ops/test_tree_attention_triton_variants.py tests/ops/test_properties_tree_attention.py tests/ops/test_tree_attention_fp8.py tests/ops/test_tree_attention_fp8_key_products.py > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
