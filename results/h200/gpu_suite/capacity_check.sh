set -u
python3 -m pytest -q -p no:cacheprovider tests/test_sharding.py -k capacity 2>&1 | tail -2
echo "--- a 7B config that cannot fit one H200"
python3 -m scripts.decode --config=configs/qwen7b.py --config.batch_size=64 --config.max_len=131072 > /tmp/o.txt 2> /tmp/e.txt; echo "rc $?"; head -c 1500 /tmp/e.txt; head -5 /tmp/o.txt
echo "--- --config.mem_fraction=0.95 and a config that fits: the plan printed"
python3 -m scripts.decode --config=configs/qwen7b.py --config.batch_size=2 --config.prompt_len=1024 --config.max_len=2048 --config.max_new_tokens=8 --config.mem_fraction=0.95 > /tmp/o.txt 2> /tmp/e.txt; echo "rc $?"; grep -v "^I1" /tmp/e.txt | head -5; head -20 /tmp/o.txt
