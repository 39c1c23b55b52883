"""heatmap_example: the toy examples of d2l.ai's "Attention Scoring Functions",
run on attention-server, with the attention weights drawn as heatmaps (like
the book's show_heatmaps) into a PNG.

    python client/python/examples/heatmap_example.py --target 127.0.0.1:50051 \\
        --output attention_heatmaps.png

(with the attention-client package installed; see client/README.md).

Both toys use a minibatch of 2 with 10 key-value pairs, values of size 4 and
valid lengths (2, 6), so only the first 2 and 6 keys get weight:
  - scaled dot product (built-in model `dot_product`): queries (2, 1, 2);
  - additive attention (model `additive_toy`, 8 hidden units, from
    tests/conformance/models): queries (2, 1, 20), keys all ones (2, 10, 2),
    values arange(40) as (10, 4) per example.
A server without `additive_toy` gets only the dot-product panel.
"""

import argparse
import os
import sys

import matplotlib
matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
import numpy as np  # noqa: E402

from attention_client import AttentionClient  # noqa: E402 (after matplotlib's backend)


def show_heatmaps(matrices, xlabel, ylabel, titles=None, figsize=(2.5, 2.5), cmap="Reds"):
    """d2l's show_heatmaps: matrices (rows, cols, n_q, n_k), one panel each."""
    num_rows, num_cols = matrices.shape[:2]
    fig, axes = plt.subplots(num_rows, num_cols, figsize=figsize, sharex=True, sharey=True,
                             squeeze=False)
    for i, (row_axes, row_matrices) in enumerate(zip(axes, matrices)):
        for j, (ax, matrix) in enumerate(zip(row_axes, row_matrices)):
            image = ax.imshow(matrix, cmap=cmap, vmin=0.0, vmax=1.0)
            if i == num_rows - 1:
                ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel(ylabel)
            if titles:
                ax.set_title(titles[j])
    fig.colorbar(image, ax=axes, shrink=0.6)
    return fig


def toy_requests(rng):
    """The book's toy inputs: (title, model, queries, keys, values)."""
    keys = rng.normal(size=(2, 10, 2))
    values = rng.normal(size=(2, 10, 4))
    yield "Scaled dot product", "dot_product", rng.normal(size=(2, 1, 2)), keys, values
    additive_values = np.tile(np.arange(40, dtype=np.float32).reshape(1, 10, 4), (2, 1, 1))
    yield ("Additive", "additive_toy", rng.normal(size=(2, 1, 20)), np.ones((2, 10, 2)),
           additive_values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.environ.get("ATTENTION_TARGET", "127.0.0.1:50051"))
    parser.add_argument("--output", default="attention_heatmaps.png")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args()

    valid_lens = [2, 6]
    with AttentionClient(args.target) as client:
        served = {model.name for model in client.list_models()}
        titles, panels = [], []
        for title, model, queries, keys, values in toy_requests(np.random.default_rng(0)):
            if model not in served:
                print(f"note: model {model} is not served (start the server with "
                      "--model-repository tests/conformance/models); skipping it",
                      file=sys.stderr)
                continue
            result = client.attend(queries, keys, values, model=model, valid_lens=valid_lens,
                                   return_attention_weights=True)
            print(f"{title} ({model}): output {result.output.shape}, "
                  f"weights {result.attention_weights.shape}")
            titles.append(title)
            panels.append(result.attention_weights.reshape(2, 10))

    figsize = (3.0 * len(panels), 2.5)
    fig = show_heatmaps(np.stack(panels)[np.newaxis], xlabel="Keys", ylabel="Queries",
                        titles=titles, figsize=figsize)
    fig.savefig(args.output, dpi=args.dpi)
    width, height = (round(side * args.dpi) for side in figsize)
    print(f"wrote {args.output} ({width}x{height} px)")


if __name__ == "__main__":
    main()
