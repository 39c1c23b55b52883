// reference_attention.cc: ReferenceAttention.
#include "tests/core/reference_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace attention::testing {
namespace {

// y = x W^T + b for one row; W is [out, in].
std::vector<double> Linear(const float* x, const RowMatrix& w, const Vector* b) {
  std::vector<double> y(w.rows(), 0.0);
  for (int64_t o = 0; o < w.rows(); ++o) {
    for (int64_t i = 0; i < w.cols(); ++i) y[o] += double{w(o, i)} * x[i];
    if (b && b->size() > 0) y[o] += (*b)(o);
  }
  return y;
}

// One single-head attention over rows: scores -> mask -> softmax -> output.
void Attend(const std::vector<std::vector<double>>& scores, const std::vector<std::vector<double>>& values,
            const std::vector<int64_t>& limit, bool causal, std::vector<std::vector<double>>& output,
            std::vector<std::vector<double>>& weights) {
  const size_t n_q = scores.size(), n_k = values.size();
  output.assign(n_q, std::vector<double>(values.empty() ? 0 : values[0].size(), 0.0));
  weights.assign(n_q, std::vector<double>(n_k, 0.0));
  for (size_t i = 0; i < n_q; ++i) {
    std::vector<double> s = scores[i];
    for (size_t j = 0; j < n_k; ++j) {
      const bool allowed = static_cast<int64_t>(j) < limit[i] && (!causal || j <= i);
      if (!allowed) s[j] = -1e6;
    }
    const double max = *std::max_element(s.begin(), s.end());
    double sum = 0;
    for (double& x : s) sum += (x = std::exp(x - max));
    for (size_t j = 0; j < n_k; ++j) {
      weights[i][j] = s[j] / sum;
      for (size_t c = 0; c < output[i].size(); ++c) output[i][c] += weights[i][j] * values[j][c];
    }
  }
}

}  // namespace

AttentionResult ReferenceAttention(const Model& packed_model, const AttentionRequest& request) {
  // A loaded multi_head model holds its weights only packed: the reference
  // reads them row-major, rebuilt.
  Model model = packed_model;
  UnpackProjections(model);
  const TensorView& q = request.queries;
  const TensorView& k = request.keys ? *request.keys : q;
  const TensorView& v = request.values ? *request.values : k;
  const int64_t B = q.shape[0], n_q = q.shape[1], d_q = q.shape[2];
  const int64_t n_k = k.shape[1], d_k = k.shape[2], d_v = v.shape[2];
  const float* qd = q.data.data();
  const float* kd = k.data.data();
  const float* vd = v.data.data();
  const bool multi = model.kind == Kind::kMultiHead;
  const int64_t heads = multi ? model.num_heads : 1;
  const int64_t out_size = multi ? model.output_size : d_v;

  AttentionResult result;
  result.output.shape = {B, n_q, out_size};
  result.output.data.assign(B * n_q * out_size, 0.0f);
  result.attention_weights.shape = multi ? std::vector<int64_t>{B, heads, n_q, n_k}
                                         : std::vector<int64_t>{B, n_q, n_k};
  result.attention_weights.data.assign(B * heads * n_q * n_k, 0.0f);

  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> limit(n_q, n_k);
    for (int64_t i = 0; i < n_q; ++i) {
      const size_t lens = request.valid_lens.size();
      if (lens == static_cast<size_t>(B)) limit[i] = request.valid_lens[b];
      if (lens == static_cast<size_t>(B * n_q) && lens != static_cast<size_t>(B)) {
        limit[i] = request.valid_lens[b * n_q + i];
      }
    }
    const float* qb = qd + b * n_q * d_q;
    const float* kb = kd + b * n_k * d_k;
    const float* vb = vd + b * n_k * d_v;
    std::vector<std::vector<double>> out, w;
    if (!multi) {
      std::vector<std::vector<double>> scores(n_q, std::vector<double>(n_k));
      std::vector<std::vector<double>> values(n_k, std::vector<double>(d_v));
      for (int64_t j = 0; j < n_k; ++j) {
        for (int64_t c = 0; c < d_v; ++c) values[j][c] = vb[j * d_v + c];
      }
      for (int64_t i = 0; i < n_q; ++i) {
        for (int64_t j = 0; j < n_k; ++j) {
          const float* qi = qb + i * d_q;
          const float* kj = kb + j * d_k;
          double s = 0;
          switch (model.kind) {
            case Kind::kDotProduct: {
              for (int64_t c = 0; c < d_q; ++c) s += double{qi[c]} * kj[c];
              s *= request.scale ? *request.scale : 1.0 / std::sqrt(double(d_q));
              break;
            }
            case Kind::kDistance: {
              for (int64_t c = 0; c < d_q; ++c) s += (double{qi[c]} - kj[c]) * (double{qi[c]} - kj[c]);
              s *= -(request.scale ? *request.scale : 1.0) / 2;
              break;
            }
            case Kind::kBilinear: {
              std::vector<double> wk = Linear(kj, model.w_k, nullptr);
              for (int64_t c = 0; c < d_q; ++c) s += double{qi[c]} * wk[c];
              s *= request.scale ? *request.scale : 1.0 / std::sqrt(double(d_q));
              break;
            }
            case Kind::kAdditive: {
              std::vector<double> a = Linear(qi, model.w_q, nullptr);
              std::vector<double> c2 = Linear(kj, model.w_k, nullptr);
              for (size_t h = 0; h < a.size(); ++h) s += double{model.w_v(0, h)} * std::tanh(a[h] + c2[h]);
              break;
            }
            case Kind::kMultiHead:
              break;
          }
          scores[i][j] = s;
        }
      }
      Attend(scores, values, limit, request.causal, out, w);
      for (int64_t i = 0; i < n_q; ++i) {
        for (int64_t c = 0; c < d_v; ++c) result.output.data[(b * n_q + i) * d_v + c] = out[i][c];
        for (int64_t j = 0; j < n_k; ++j) result.attention_weights.data[(b * n_q + i) * n_k + j] = w[i][j];
      }
      continue;
    }
    const int64_t E = model.output_size, hs = E / heads;
    std::vector<std::vector<double>> qp, kp, vp;
    for (int64_t i = 0; i < n_q; ++i) qp.push_back(Linear(qb + i * d_q, model.w_q, &model.b_q));
    for (int64_t j = 0; j < n_k; ++j) kp.push_back(Linear(kb + j * d_k, model.w_k, &model.b_k));
    for (int64_t j = 0; j < n_k; ++j) vp.push_back(Linear(vb + j * d_v, model.w_v, &model.b_v));
    std::vector<std::vector<float>> concat(n_q, std::vector<float>(E));
    for (int64_t h = 0; h < heads; ++h) {
      std::vector<std::vector<double>> scores(n_q, std::vector<double>(n_k));
      std::vector<std::vector<double>> values(n_k, std::vector<double>(hs));
      const double scale = request.scale ? *request.scale : 1.0 / std::sqrt(double(hs));
      for (int64_t i = 0; i < n_q; ++i) {
        for (int64_t j = 0; j < n_k; ++j) {
          double s = 0;
          for (int64_t c = 0; c < hs; ++c) s += qp[i][h * hs + c] * kp[j][h * hs + c];
          scores[i][j] = s * scale;
        }
      }
      for (int64_t j = 0; j < n_k; ++j) {
        for (int64_t c = 0; c < hs; ++c) values[j][c] = vp[j][h * hs + c];
      }
      Attend(scores, values, limit, request.causal, out, w);
      for (int64_t i = 0; i < n_q; ++i) {
        for (int64_t c = 0; c < hs; ++c) concat[i][h * hs + c] = static_cast<float>(out[i][c]);
        for (int64_t j = 0; j < n_k; ++j) {
          result.attention_weights.data[((b * heads + h) * n_q + i) * n_k + j] = w[i][j];
        }
      }
    }
    for (int64_t i = 0; i < n_q; ++i) {
      std::vector<double> y = Linear(concat[i].data(), model.w_o, &model.b_o);
      for (int64_t c = 0; c < E; ++c) result.output.data[(b * n_q + i) * E + c] = y[c];
    }
  }
  return result;
}

}  // namespace attention::testing
