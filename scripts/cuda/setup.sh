# On the device (second call, repo root): assemble the carried fbgemm chunks, install the wheels
# into /tmp/site, check that torchrec and fbgemm's CUDA ops load. Writes /tmp/dev/env.
set -u
cat /tmp/dev/fb.00 .dev/fb.01 > /tmp/dev/fb.tar.zst
sha256sum -c .dev/fb.sha256 || exit 3
tar -xf .dev/small.tar -C /tmp/dev
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/dev/small/*.whl
PYTHONPATH=/tmp/site python3 -c "
import tarfile, zstandard
with open('/tmp/dev/fb.tar.zst', 'rb') as f:
    tarfile.open(fileobj=zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(f), mode='r|').extractall('/tmp/site')
"
PYTHONPATH=/tmp/site python3 -c 'import torch, torchrec, fbgemm_gpu; print("torch", torch.__version__, "torchrec", torchrec.__version__, "fbgemm", fbgemm_gpu.__version__); print(torch.ops.fbgemm.asynchronous_complete_cumsum(torch.tensor([1, 2, 3], device="cuda")))' || exit 4
echo "PYTHONPATH=/tmp/site" > /tmp/dev/env
