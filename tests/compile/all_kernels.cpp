// Instantiates every kernel of the library in one translation unit, so that CI can prove the whole library
// compiles for a GPU target without building every test and benchmark for it (see .ci/run).
#include <vsa/gpu/layout.hpp>
#include <vsa/gpu/linear_attention.hpp>
#include <vsa/gpu/op.hpp>
#include <vsa/gpu/packed_op.hpp>

// Every entry point dispatches on dtype and head dim at run time, so one call of each instantiates all of
// its kernels.
vsa::status vsa_instantiate_all(vsa::gpu::stream_t stream) {
  vsa::problem p{};
  vsa::options opt{};
  vsa::forward_io f{};
  vsa::backward_io b{};
  vsa::const_tensor c{};
  vsa::tensor t{};
  vsa::index_lists idx{};
  std::size_t bytes = 0;
  vsa::packed_problem pp{};
  vsa::status s = vsa::forward(p, opt, f, nullptr, bytes, stream);
  if (s) s = vsa::packed_forward(pp, opt, f, nullptr, bytes, stream);
  if (s) s = vsa::backward(p, opt, b, nullptr, bytes, stream);
  if (s) s = vsa::packed_backward(pp, opt, b, nullptr, bytes, stream);
  if (s) s = vsa::tile(p, 1, c, t, stream);
  if (s) s = vsa::untile(p, 1, c, t, stream);
  if (s) s = vsa::combine(p, c, c, nullptr, t, stream);
  if (s) s = vsa::select_top_k(p, 1, nullptr, idx, nullptr, bytes, stream);
  if (s)
    s = vsa::linear_attention_forward(p, vsa::feature_map{}, 0.f, vsa::token_order{}, c, c, c, t, nullptr, bytes,
                                      stream);
  if (s)
    s = vsa::linear_attention_backward(p, vsa::feature_map{}, 0.f, vsa::token_order{}, c, c, c, c, t, t, t, nullptr,
                                       bytes, stream);
  return s;
}
