# Container image for attention-server (with attention-client for health checks).
#
# One image for every x86-64 CPU with AVX2: the build stage compiles the server
# twice, for x86-64-v3 (AVX2/FMA) and x86-64-v4 (AVX-512), and
# /usr/local/bin/attention-server is a small dispatcher that execs the AVX-512
# build when /proc/cpuinfo has the x86-64-v4 flags, else the AVX2 one. The
# tests run once, on the x86-64-v3 build, because the build machine may lack
# AVX-512. Configuration is through ATTENTION_* variables (see deploy/README.md);
# models are read from /models, which holds the example models by default.

FROM debian:bookworm AS build
WORKDIR /src
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN scripts/install-deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
# The deploy tests need Prometheus, kubectl and npm, and the Node client test
# installs packages from the npm registry; they run in CI, not here.
RUN cmake -S . -B /build/avx2 -G Ninja -DATTENTION_ARCH=x86-64-v3 -DATTENTION_BUILD_BENCHMARKS=OFF \
 && ninja -C /build/avx2 -j 2 \
 && ctest --test-dir /build/avx2 --output-on-failure -j 2 -LE "deploy|npm"
RUN cmake -S . -B /build/avx512 -G Ninja -DATTENTION_ARCH=x86-64-v4 \
      -DATTENTION_BUILD_TESTS=OFF -DATTENTION_BUILD_BENCHMARKS=OFF \
 && ninja -C /build/avx512 -j 2 attention-server
RUN install -D -m 0755 /build/avx2/server/attention-server /out/attention-server-avx2 \
 && install -D -m 0755 /build/avx512/server/attention-server /out/attention-server-avx512 \
 && install -D -m 0755 /build/avx2/client/attention-client /out/attention-client \
 && install -D -m 0755 deploy/attention-server-dispatch.sh /out/attention-server

FROM debian:bookworm-slim
COPY scripts/install-deps.sh /tmp/install-deps.sh
RUN /tmp/install-deps.sh --runtime && rm -rf /var/lib/apt/lists/* /tmp/install-deps.sh \
 && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin attention
COPY --from=build /out/ /usr/local/bin/
COPY models/ /models/

ENV ATTENTION_ADDRESS=0.0.0.0:50051 \
    ATTENTION_METRICS_ADDRESS=0.0.0.0:9464 \
    ATTENTION_MODEL_REPOSITORY=/models
USER 10001
EXPOSE 50051 9464
# Probes the gRPC health service on whatever port ATTENTION_ADDRESS names.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD attention-client health --target "127.0.0.1:${ATTENTION_ADDRESS##*:}" || exit 1
ENTRYPOINT ["attention-server"]
