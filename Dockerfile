# Container image for attention-server (with attention-client for health checks).
#
# One build for every x86-64 CPU: the kernels choose their vector path (avx512,
# avx2 or portable) from CPUID at startup, and OpenBLAS is kept to kernels that
# match the CPU (core/kernels/cpu_features.h, core/kernels/blas.h), so nothing here depends on
# the build machine's CPU and nothing needs to be set at run time. By default
# the build stage compiles only the two binaries the image ships (CI runs the
# tests); --build-arg ATTENTION_TESTS=ON builds and runs the tests there too,
# each kernel path the build machine has included.
# Configuration is through ATTENTION_* variables (see deploy/README.md); models
# are read from /models, which holds the example models by default. The
# entrypoint is the bare server; on an untrusted network run it behind the
# edge instead: entrypoint /usr/local/share/attention-edge/run.sh --listen
# 0.0.0.0:50051 -- (as deploy/compose does).

FROM debian:bookworm AS build
ARG ATTENTION_TESTS=OFF
WORKDIR /src
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN if [ "$ATTENTION_TESTS" = ON ]; then scripts/install-deps.sh; \
    else scripts/install-deps.sh --build; fi \
 && rm -rf /var/lib/apt/lists/*
COPY . .
# With the tests: the deploy tests need Prometheus, kubectl and npm, and the
# Node client test installs packages from the npm registry; they run in CI,
# not here. So do the abuse suite (label abuse), whose latency bound needs
# a quiet machine, and the cluster suite (label cluster: failed calls under
# faults, network namespaces).
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTENTION_BUILD_BENCHMARKS=OFF \
      -DATTENTION_BUILD_TESTS="$ATTENTION_TESTS" \
 && if [ "$ATTENTION_TESTS" = ON ]; then \
      ninja -C /build -j 2 \
      && ctest --test-dir /build --output-on-failure -j 2 -LE "deploy|npm|abuse|cluster"; \
    else ninja -C /build -j 2 attention-server attention-client; fi
RUN install -D -m 0755 /build/server/attention-server /out/attention-server \
 && install -D -m 0755 /build/client/attention-client /out/attention-client

FROM debian:bookworm-slim
COPY scripts/install-deps.sh /tmp/install-deps.sh
RUN /tmp/install-deps.sh --runtime && rm -rf /var/lib/apt/lists/* /tmp/install-deps.sh \
 && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin attention
COPY --from=build /out/ /usr/local/bin/
COPY models/ /models/
# The HTTP/2 edge (HAProxy, installed by install-deps.sh --runtime): run.sh
# starts the servers behind it (the compose stack's entrypoint; backends.sh
# writes its backends); the Kubernetes sidecar runs haproxy on haproxy.cfg
# and sidecar.cfg, the edge Deployment on haproxy.cfg and cluster.cfg. See
# docs/api.md sections 6.8 and 6.11.
COPY deploy/edge/run.sh deploy/edge/backends.sh deploy/edge/haproxy.cfg deploy/edge/sidecar.cfg \
     deploy/edge/cluster.cfg /usr/local/share/attention-edge/
COPY deploy/edge/errors/ /usr/local/share/attention-edge/errors/

ENV ATTENTION_ADDRESS=0.0.0.0:50051 \
    ATTENTION_HTTP_ADDRESS=0.0.0.0:8000 \
    ATTENTION_METRICS_ADDRESS=0.0.0.0:9464 \
    ATTENTION_MODEL_REPOSITORY=/models
USER 10001
EXPOSE 50051 8000 9464
# Probes the gRPC health service on whatever port ATTENTION_ADDRESS names.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD attention-client health --target "127.0.0.1:${ATTENTION_ADDRESS##*:}" || exit 1
ENTRYPOINT ["attention-server"]
