// Bad-argument matrix of every GPU entry point: each rejected argument returns its own error code and a
// message naming the argument, and leaves every buffer (outputs, inputs, workspace, and the canaries around
// them) exactly as it was. Then NaN/Inf inputs: selection and the whole op still return valid index lists.
// Last, a sweep over random problems that calls every entry point, for the sanitizer runs
// (scripts/sanitize-gpu runs the [sanitize] cases under compute-sanitizer).
#include "support/gpu.hpp"
#include "support/host.hpp"

#include <vsa/gpu/linear_attention.hpp>
#include <vsa/gpu/layout.hpp>
#include <vsa/gpu/op.hpp>
#include <vsa/reference.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace vsa {
namespace test {
namespace {

// ---- the arguments of every entry point, valid by default ---------------------------------------------------

// Every pointer and view any entry point takes, all valid for one problem; a case changes one of them.
struct arguments {
  problem p;
  int64_t heads = 0; // tile / untile
  float scale = 0.125f;
  int64_t top_k = 0;
  tensor q, k, v, o, o_s, gate, d_o, dq, dk, dv, dgate, raster;
  void *q_c = nullptr, *k_c = nullptr, *v_c = nullptr, *o_c = nullptr, *d_o_c = nullptr;
  float *lse_c = nullptr, *scores = nullptr, *lse = nullptr, *dq_c = nullptr, *dk_c = nullptr, *dv_c = nullptr;
  index_lists idx;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  feature_map phi = feature_map::elu1;
  float eps = 1e-6f;
  token_order order = token_order::tiled;
  linear_state kept; // none: the linear forward keeps no state, the backward recomputes it
  options opt;
};

using entry_point = std::function<status(arguments&)>;

// The device memory behind `arguments`: tensors with twice the room they need, so that views with padded
// strides stay inside their allocation, and a workspace large enough for every entry point.
class state {
public:
  state() : p_(make_problem({5, 6, 7}, 1, 4, 2, 64, dtype::bf16)) {
    const tile_geometry geo(p_.grid);
    n_ = geo.num_tiles();
    tokens_ = geo.tiled_tokens();
    const std::size_t e = dtype_size(p_.type), d = static_cast<std::size_t>(p_.head_dim);
    const std::size_t bq = static_cast<std::size_t>(p_.batch * p_.q_heads),
                      bk = static_cast<std::size_t>(p_.batch * p_.kv_heads);
    const std::size_t slots = static_cast<std::size_t>(tokens_), tiles = static_cast<std::size_t>(n_);
    for (const char* name : {"q", "o", "o_s", "gate", "d_o", "dq", "dgate"}) add(name, 2 * bq * slots * d * e, false);
    for (const char* name : {"k", "v", "dk", "dv"}) add(name, 2 * bk * slots * d * e, false);
    add("raster", 2 * bq * static_cast<std::size_t>(geo.raster_tokens()) * d * e, false);
    for (const char* name : {"q_c", "o_c", "d_o_c"}) add(name, bq * tiles * d * e, false);
    for (const char* name : {"k_c", "v_c"}) add(name, bk * tiles * d * e, false);
    add("lse_c", bq * tiles * 4, false);
    add("scores", bq * tiles * tiles * 4, false);
    add("lse", bq * slots * 4, false);
    add("dq_c", bq * tiles * d * 4, false);
    add("dk_c", bk * tiles * d * 4, false);
    add("dv_c", bk * tiles * d * 4, false);
    add("q2k", bq * tiles * tiles * 4, true);
    add("q2k_count", bq * tiles * 4, true);
    add("k2q", bq * tiles * tiles * 4, true);
    add("k2q_offset", bq * (tiles + 1) * 4, true);
    add("workspace", std::size_t(8) << 20, false);
    // Valid lists (k = 2 for every row) so that a call that wrongly runs reads sane indices.
    capacity_ = 2;
    std::vector<int32_t> q2k(bq * tiles * tiles, -1), count(bq * tiles, 2);
    for (std::size_t r = 0; r < bq * tiles; ++r) {
      q2k[r * 2] = static_cast<int32_t>(r % tiles);
      q2k[r * 2 + 1] = static_cast<int32_t>((r + 1) % tiles);
      if (q2k[r * 2] > q2k[r * 2 + 1]) std::swap(q2k[r * 2], q2k[r * 2 + 1]);
    }
    std::vector<int32_t> k2q(bq * tiles * tiles, -1), offset(bq * (tiles + 1), 0);
    const index_lists host{q2k.data(), count.data(), capacity_, k2q.data(), offset.data()};
    REQUIRE(reference::build_k2q(p_, host).is_ok());
    buffer("q2k").upload_bytes(q2k.data(), q2k.size() * 4);
    buffer("q2k_count").upload_bytes(count.data(), count.size() * 4);
    buffer("k2q").upload_bytes(k2q.data(), k2q.size() * 4);
    buffer("k2q_offset").upload_bytes(offset.data(), offset.size() * 4);
  }

  arguments defaults() {
    arguments a;
    a.p = p_;
    a.heads = p_.q_heads;
    a.top_k = capacity_;
    const auto view = [&](const char* name, int64_t heads, int64_t tokens) {
      return bshd<void*>(buffer(name).get(), p_.batch, tokens, heads, p_.head_dim);
    };
    a.q = view("q", p_.q_heads, tokens_);
    a.k = view("k", p_.kv_heads, tokens_);
    a.v = view("v", p_.kv_heads, tokens_);
    a.o = view("o", p_.q_heads, tokens_);
    a.o_s = view("o_s", p_.q_heads, tokens_);
    a.gate = view("gate", p_.q_heads, tokens_);
    a.d_o = view("d_o", p_.q_heads, tokens_);
    a.dq = view("dq", p_.q_heads, tokens_);
    a.dk = view("dk", p_.kv_heads, tokens_);
    a.dv = view("dv", p_.kv_heads, tokens_);
    a.dgate = view("dgate", p_.q_heads, tokens_);
    a.raster = view("raster", p_.q_heads, tile_geometry(p_.grid).raster_tokens());
    a.q_c = buffer("q_c").get();
    a.k_c = buffer("k_c").get();
    a.v_c = buffer("v_c").get();
    a.o_c = buffer("o_c").get();
    a.d_o_c = buffer("d_o_c").get();
    a.lse_c = buffer("lse_c").as<float>();
    a.scores = buffer("scores").as<float>();
    a.lse = buffer("lse").as<float>();
    a.dq_c = buffer("dq_c").as<float>();
    a.dk_c = buffer("dk_c").as<float>();
    a.dv_c = buffer("dv_c").as<float>();
    a.idx = {buffer("q2k").as<int32_t>(), buffer("q2k_count").as<int32_t>(), capacity_, buffer("k2q").as<int32_t>(),
             buffer("k2q_offset").as<int32_t>()};
    a.workspace = buffer("workspace").get();
    a.workspace_bytes = buffer("workspace").bytes();
    a.opt.top_k = capacity_;
    return a;
  }

  // Every buffer's bytes, to compare after a call.
  std::vector<std::vector<unsigned char>> snapshot() const {
    std::vector<std::vector<unsigned char>> s;
    for (const auto& b : buffers_) s.push_back(b.second.download_bytes());
    return s;
  }
  // CHECKs that every buffer holds what `before` recorded and that every canary is intact.
  void check_untouched(const std::vector<std::vector<unsigned char>>& before) const {
    VSA_REQUIRE_RT(gpu_sync());
    REQUIRE(before.size() == buffers_.size());
    for (std::size_t i = 0; i < buffers_.size(); ++i) {
      INFO("buffer " << buffers_[i].first);
      CHECK(buffers_[i].second.download_bytes() == before[i]);
      CHECK(buffers_[i].second.canaries_intact());
    }
  }

private:
  void add(const char* name, std::size_t bytes, bool index) {
    buffers_.emplace_back(name, device_buffer(bytes));
    if (index)
      buffers_.back().second.poison_indices();
    else
      buffers_.back().second.poison();
  }
  device_buffer& buffer(const std::string& name) {
    for (auto& b : buffers_)
      if (b.first == name) return b.second;
    FAIL("no buffer " << name);
    return buffers_.front().second;
  }

  problem p_;
  int64_t n_ = 0, tokens_ = 0, capacity_ = 0;
  std::vector<std::pair<std::string, device_buffer>> buffers_;
};

// ---- the cases ----------------------------------------------------------------------------------------------

struct bad_case {
  std::string name;
  std::function<void(arguments&)> change;
  errc code;
  std::string word; // the message starts with "word:" (an argument) or, for problem-level cases, mentions it
  bool prefix;
};

// What every entry point rejects: the problem itself.
std::vector<bad_case> problem_cases() {
  return {
      {"head_dim 96", [](arguments& a) { a.p.head_dim = 96; }, errc::bad_head_dim, "head_dim", true},
      {"dtype f32", [](arguments& a) { a.p.type = dtype::f32; }, errc::bad_dtype, "type", true},
      {"dtype f64", [](arguments& a) { a.p.type = dtype::f64; }, errc::bad_dtype, "type", true},
      {"kv_heads 3 does not divide q_heads 4", [](arguments& a) { a.p.kv_heads = 3; }, errc::bad_heads, "kv_heads",
       false},
      {"kv_heads 0", [](arguments& a) { a.p.kv_heads = 0; }, errc::bad_heads, "kv_heads", false},
      {"batch 0", [](arguments& a) { a.p.batch = 0; }, errc::bad_batch, "batch", true},
      {"batch -1", [](arguments& a) { a.p.batch = -1; }, errc::bad_batch, "batch", true},
      {"grid t = 0", [](arguments& a) { a.p.grid.t = 0; }, errc::bad_grid, "grid", true},
      {"grid w = -4", [](arguments& a) { a.p.grid.w = -4; }, errc::bad_grid, "grid", true},
      {"grid overflowing",
       [](arguments& a) {
         a.p.grid = {int64_t(1) << 40, int64_t(1) << 40, int64_t(1) << 40};
       },
       errc::bad_grid, "grid", true},
      {"grid of more than 2^30 tiles",
       [](arguments& a) {
         a.p.grid = {int64_t(1) << 12, int64_t(1) << 12, 1 << 14};
       },
       errc::bad_grid, "grid", true},
  };
}

// What a tensor argument `name` (a member of arguments) must not be.
std::vector<bad_case> tensor_cases(const std::string& name, tensor arguments::*member) {
  const auto with = [member](std::function<void(tensor&)> f) { return [member, f](arguments& a) { f(a.*member); }; };
  return {
      {name + " null", with([](tensor& t) { t.data = nullptr; }), errc::null_pointer, name, true},
      {name + " misaligned pointer", with([](tensor& t) { t.data = static_cast<char*>(t.data) + 2; }),
       errc::misaligned_pointer, name, true},
      // A token stride of H·D + 4 elements: no overlap, but rows are not 16-byte aligned.
      {name + " misaligned stride", with([](tensor& t) { t.token_stride += 4; }), errc::misaligned_pointer, name, true},
      {name + " overlapping strides", with([](tensor& t) { t.token_stride = t.head_stride; }), errc::bad_strides, name,
       true},
      {name + " head dim not contiguous", with([](tensor& t) { t.head_stride /= 2; }), errc::bad_strides, name, true},
      {name + " negative stride", with([](tensor& t) { t.token_stride = -t.token_stride; }), errc::bad_strides, name,
       true},
      {name + " token count not matching the grid", with([](tensor& t) { t.tokens -= 64; }), errc::bad_tokens, name,
       true},
  };
}

// What a plain pointer argument must not be: null, or off its alignment.
template <class T> std::vector<bad_case> pointer_cases(const std::string& name, T* arguments::*member) {
  return {
      {name + " null", [member](arguments& a) { a.*member = nullptr; }, errc::null_pointer, name, true},
      {name + " misaligned",
       [member](arguments& a) { a.*member = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(a.*member) + 2); },
       errc::misaligned_pointer, name, true},
  };
}

std::vector<bad_case> list_cases(const std::string& name, int32_t* index_lists::*member) {
  return {
      {name + " null", [member](arguments& a) { a.idx.*member = nullptr; }, errc::null_pointer, name, true},
      {name + " misaligned",
       [member](arguments& a) {
         a.idx.*member = reinterpret_cast<int32_t*>(reinterpret_cast<unsigned char*>(a.idx.*member) + 2);
       },
       errc::misaligned_pointer, name, true},
  };
}

std::vector<bad_case> workspace_cases() {
  return {
      {"workspace one byte short", [](arguments& a) { a.workspace_bytes -= 1; }, errc::bad_workspace, "workspace",
       true},
      {"workspace misaligned", [](arguments& a) { a.workspace = static_cast<unsigned char*>(a.workspace) + 16; },
       errc::misaligned_pointer, "workspace", true},
  };
}

std::vector<bad_case> scale_cases(float arguments::*member) {
  return {
      {"scale 0", [member](arguments& a) { a.*member = 0.0f; }, errc::bad_argument, "scale", true},
      {"scale negative", [member](arguments& a) { a.*member = -1.0f; }, errc::bad_argument, "scale", true},
      {"scale NaN", [member](arguments& a) { a.*member = std::numeric_limits<float>::quiet_NaN(); }, errc::bad_argument,
       "scale", true},
      {"scale inf", [member](arguments& a) { a.*member = std::numeric_limits<float>::infinity(); }, errc::bad_argument,
       "scale", true},
  };
}

std::vector<bad_case> capacity_cases(int64_t n) {
  return {
      {"q2k_capacity 0", [](arguments& a) { a.idx.q2k_capacity = 0; }, errc::bad_index, "q2k_capacity", true},
      {"q2k_capacity N + 1", [n](arguments& a) { a.idx.q2k_capacity = n + 1; }, errc::bad_index, "q2k_capacity", true},
  };
}

template <class... Lists> std::vector<bad_case> join(std::vector<bad_case> first, Lists... rest) {
  for (const auto& list : {rest...}) first.insert(first.end(), list.begin(), list.end());
  return first;
}

// The workspace size the entry point asks for with these (valid) arguments; 0 when it takes none.
std::size_t asked_size(const entry_point& call, arguments a) {
  a.workspace = nullptr;
  a.workspace_bytes = 0;
  const status s = call(a);
  INFO(s.message());
  REQUIRE(s.is_ok());
  return a.workspace_bytes;
}

// Runs every case as its own section: the call fails with the case's code, the message names the argument,
// and no buffer changes. With a workspace, the size query is exact first (so "one byte short" is short); or, for an
// entry point that takes any workspace from a least size up (`least`), that least size.
void run_cases(const entry_point& call, const std::vector<bad_case>& cases, bool has_workspace,
               std::size_t (*least)(const arguments&) = nullptr) {
  state st;
  for (const bad_case& c : cases) {
    DYNAMIC_SECTION(c.name) {
      arguments a = st.defaults();
      if (has_workspace) {
        const std::size_t need = asked_size(call, a);
        REQUIRE(need > 0);
        REQUIRE(need <= a.workspace_bytes);
        a.workspace_bytes = need;
        if (least != nullptr) {
          REQUIRE(least(a) <= need);
          a.workspace_bytes = least(a);
        }
      }
      c.change(a);
      const auto before = st.snapshot();
      const status s = call(a);
      INFO("status " << errc_name(s.code()) << ": " << s.message());
      CHECK(s.code() == c.code);
      if (c.prefix)
        CHECK(std::string(s.message()).rfind(c.word + ":", 0) == 0);
      else
        CHECK(mentions(s, c.word.c_str()));
      st.check_untouched(before);
    }
  }
  // The size query itself touches nothing either.
  if (has_workspace) {
    SECTION("size query") {
      arguments a = st.defaults();
      const auto before = st.snapshot();
      a.workspace = nullptr;
      a.workspace_bytes = 0;
      REQUIRE(call(a).is_ok());
      CHECK(a.workspace_bytes > 0);
      st.check_untouched(before);
    }
  }
}

int64_t tiles_of_default() { return tile_geometry(make_problem({5, 6, 7}, 1, 4, 2, 64, dtype::bf16).grid).num_tiles(); }

} // namespace

// ---- one test case per entry point ---------------------------------------------------------------------------

TEST_CASE("tile rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) { return tile(a.p, a.heads, a.raster, a.o, nullptr); };
  std::vector<bad_case> heads = {
      {"heads 0", [](arguments& a) { a.heads = 0; }, errc::bad_heads, "heads", true},
      {"heads -1", [](arguments& a) { a.heads = -1; }, errc::bad_heads, "heads", true},
  };
  const std::vector<bad_case> aliasing = {
      {"tiled over raster", [](arguments& a) { a.o.data = a.raster.data; }, errc::aliased, "tiled", true},
  };
  run_cases(call,
            join(problem_cases(), heads, tensor_cases("raster", &arguments::raster),
                 tensor_cases("tiled", &arguments::o), aliasing),
            false);
}

TEST_CASE("untile rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) { return untile(a.p, a.heads, a.q, a.raster, nullptr); };
  const std::vector<bad_case> aliasing = {
      {"raster over tiled", [](arguments& a) { a.raster.data = a.q.data; }, errc::aliased, "raster", true},
  };
  run_cases(
      call,
      join(problem_cases(), tensor_cases("tiled", &arguments::q), tensor_cases("raster", &arguments::raster), aliasing),
      false);
}

TEST_CASE("block_means rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) { return block_means(a.p, a.q, a.k, a.v, a.q_c, a.k_c, a.v_c, nullptr); };
  const std::vector<bad_case> aliasing = {
      {"q_c over q", [](arguments& a) { a.q_c = const_cast<void*>(a.q.data); }, errc::aliased, "q_c", true},
      {"v_c over k_c", [](arguments& a) { a.v_c = a.k_c; }, errc::aliased, "k_c and v_c", false},
  };
  run_cases(call,
            join(problem_cases(), tensor_cases("q", &arguments::q), tensor_cases("k", &arguments::k),
                 tensor_cases("v", &arguments::v), pointer_cases("q_c", &arguments::q_c),
                 pointer_cases("k_c", &arguments::k_c), pointer_cases("v_c", &arguments::v_c), aliasing),
            false);
}

// The fp32 means of coarse_scores: the dq_c and dk_c buffers, which have their size.
TEST_CASE("coarse_scores rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) { return coarse_scores(a.p, a.scale, a.dq_c, a.dk_c, a.scores, nullptr); };
  const std::vector<bad_case> aliasing = {
      {"scores over q_c", [](arguments& a) { a.scores = a.dq_c; }, errc::aliased, "scores", true},
  };
  run_cases(call,
            join(problem_cases(), scale_cases(&arguments::scale), pointer_cases("q_c", &arguments::dq_c),
                 pointer_cases("k_c", &arguments::dk_c), pointer_cases("scores", &arguments::scores), aliasing),
            false);
}

TEST_CASE("coarse_attention rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) {
    return coarse_attention(a.p, a.scores, a.v_c, a.o_c, nullptr, a.lse_c, nullptr);
  };
  const std::vector<bad_case> aliasing = {
      {"v_c inside o_c", [](arguments& a) { a.v_c = a.o_c; }, errc::aliased, "o_c", true},
      {"lse_c inside o_c", [](arguments& a) { a.lse_c = static_cast<float*>(a.o_c); }, errc::aliased, "o_c and lse_c",
       false},
  };
  run_cases(call,
            join(problem_cases(), pointer_cases("scores", &arguments::scores), pointer_cases("v_c", &arguments::v_c),
                 pointer_cases("o_c", &arguments::o_c), pointer_cases("lse_c", &arguments::lse_c), aliasing),
            false);
}

TEST_CASE("coarse_attention_backward rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) {
    return coarse_attention_backward(a.p, a.scale, a.q_c, a.k_c, a.v_c, a.scores, a.o_c, nullptr, a.d_o_c, a.lse_c,
                                     a.dq_c, a.dk_c, a.dv_c, a.workspace, a.workspace_bytes, nullptr);
  };
  const std::vector<bad_case> aliasing = {
      {"d_o_c inside dq_c", [](arguments& a) { a.d_o_c = a.dq_c; }, errc::aliased, "dq_c", true},
      {"dv_c over dk_c", [](arguments& a) { a.dv_c = a.dk_c; }, errc::aliased, "dk_c and dv_c", false},
      {"dv_c over the workspace", [](arguments& a) { a.dv_c = static_cast<float*>(a.workspace); }, errc::aliased,
       "dv_c", false},
  };
  run_cases(call,
            join(problem_cases(), scale_cases(&arguments::scale), pointer_cases("q_c", &arguments::q_c),
                 pointer_cases("k_c", &arguments::k_c), pointer_cases("v_c", &arguments::v_c),
                 pointer_cases("scores", &arguments::scores), pointer_cases("o_c", &arguments::o_c),
                 pointer_cases("d_o_c", &arguments::d_o_c), pointer_cases("lse_c", &arguments::lse_c),
                 pointer_cases("dq_c", &arguments::dq_c), pointer_cases("dk_c", &arguments::dk_c),
                 pointer_cases("dv_c", &arguments::dv_c), workspace_cases(), aliasing),
            true);
}

TEST_CASE("select_top_k rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) {
    return select_top_k(a.p, a.top_k, a.scores, a.idx, a.workspace, a.workspace_bytes, nullptr);
  };
  const int64_t n = tiles_of_default();
  std::vector<bad_case> k = {
      {"k = 0", [](arguments& a) { a.top_k = 0; }, errc::bad_top_k, "top_k", true},
      {"k = -1", [](arguments& a) { a.top_k = -1; }, errc::bad_top_k, "top_k", true},
      {"k = N + 1", [n](arguments& a) { a.top_k = n + 1; }, errc::bad_top_k, "top_k", true},
      {"q2k_capacity below k", [](arguments& a) { a.idx.q2k_capacity = a.top_k - 1; }, errc::bad_index, "q2k_capacity",
       true},
      {"q2k_capacity N + 1", [n](arguments& a) { a.idx.q2k_capacity = n + 1; }, errc::bad_index, "q2k_capacity", true},
  };
  const std::vector<bad_case> aliasing = {
      {"q2k over the scores", [](arguments& a) { a.idx.q2k = reinterpret_cast<int32_t*>(a.scores); }, errc::aliased,
       "q2k", true},
      {"q2k_count inside q2k", [](arguments& a) { a.idx.q2k_count = a.idx.q2k + 1; }, errc::aliased,
       "q2k and q2k_count", false},
  };
  run_cases(call,
            join(problem_cases(), k, pointer_cases("scores", &arguments::scores), list_cases("q2k", &index_lists::q2k),
                 list_cases("q2k_count", &index_lists::q2k_count), workspace_cases(), aliasing),
            true);
}

TEST_CASE("build_k2q rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) { return build_k2q(a.p, a.idx, a.workspace, a.workspace_bytes, nullptr); };
  const std::vector<bad_case> aliasing = {
      {"k2q over q2k", [](arguments& a) { a.idx.k2q = a.idx.q2k; }, errc::aliased, "k2q", true},
      {"k2q_offset inside k2q", [](arguments& a) { a.idx.k2q_offset = a.idx.k2q + 1; }, errc::aliased,
       "k2q and k2q_offset", false},
  };
  run_cases(call,
            join(problem_cases(), capacity_cases(tiles_of_default()), list_cases("q2k", &index_lists::q2k),
                 list_cases("q2k_count", &index_lists::q2k_count), list_cases("k2q", &index_lists::k2q),
                 list_cases("k2q_offset", &index_lists::k2q_offset), workspace_cases(), aliasing),
            true);
}

TEST_CASE("sparse_attention_forward rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) {
    return sparse_attention_forward(a.p, a.scale, a.q, a.k, a.v, as_const(a.idx), a.o_s, a.lse, nullptr);
  };
  const std::vector<bad_case> aliasing = {
      {"o_s over q", [](arguments& a) { a.o_s.data = a.q.data; }, errc::aliased, "o_s", true},
      {"lse over o_s", [](arguments& a) { a.lse = static_cast<float*>(a.o_s.data); }, errc::aliased, "lse", false},
  };
  run_cases(call,
            join(problem_cases(), scale_cases(&arguments::scale), tensor_cases("q", &arguments::q),
                 tensor_cases("k", &arguments::k), tensor_cases("v", &arguments::v),
                 tensor_cases("o_s", &arguments::o_s), pointer_cases("lse", &arguments::lse),
                 list_cases("q2k", &index_lists::q2k), list_cases("q2k_count", &index_lists::q2k_count),
                 capacity_cases(tiles_of_default()), aliasing),
            false);
}

TEST_CASE("sparse_attention_backward rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) {
    return sparse_attention_backward(a.p, a.scale, a.q, a.k, a.v, a.o_s, a.d_o, a.lse, as_const(a.idx), a.dq, a.dk,
                                     a.dv, a.workspace, a.workspace_bytes, nullptr);
  };
  const std::vector<bad_case> aliasing = {
      {"dq over d_o", [](arguments& a) { a.dq.data = a.d_o.data; }, errc::aliased, "dq", true},
      {"dv over dk", [](arguments& a) { a.dv.data = a.dk.data; }, errc::aliased, "dk and dv", false},
      {"k inside dv", [](arguments& a) { a.k.data = a.dv.data; }, errc::aliased, "dv", true},
  };
  run_cases(call,
            join(problem_cases(), scale_cases(&arguments::scale), tensor_cases("q", &arguments::q),
                 tensor_cases("k", &arguments::k), tensor_cases("v", &arguments::v),
                 tensor_cases("o_s", &arguments::o_s), tensor_cases("d_o", &arguments::d_o),
                 tensor_cases("dq", &arguments::dq), tensor_cases("dk", &arguments::dk),
                 tensor_cases("dv", &arguments::dv), pointer_cases("lse", &arguments::lse),
                 list_cases("q2k", &index_lists::q2k), list_cases("q2k_count", &index_lists::q2k_count),
                 list_cases("k2q", &index_lists::k2q), list_cases("k2q_offset", &index_lists::k2q_offset),
                 capacity_cases(tiles_of_default()), workspace_cases(), aliasing),
            true, [](const arguments& a) { return sparse_attention_backward_workspace(a.p); });
}

TEST_CASE("combine rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) { return combine(a.p, a.o_s, a.gate, a.o_c, a.o, nullptr); };
  const std::vector<bad_case> all =
      join(problem_cases(), tensor_cases("o_s", &arguments::o_s), tensor_cases("gate", &arguments::gate),
           tensor_cases("o", &arguments::o), pointer_cases("o_c", &arguments::o_c));
  std::vector<bad_case> kept; // a null gate is valid (g = 1)
  for (const auto& c : all)
    if (c.name != "gate null") kept.push_back(c);
  // o over o_s exactly is in place, and accepted; any other overlap is not.
  const std::vector<bad_case> aliasing = {
      {"o over the gate", [](arguments& a) { a.o.data = a.gate.data; }, errc::aliased, "o", true},
      {"o over o_s one token off",
       [](arguments& a) { a.o.data = static_cast<char*>(a.o_s.data) + a.o_s.token_stride * 2; }, errc::aliased, "o_s",
       false},
      {"o_c inside o", [](arguments& a) { a.o_c = a.o.data; }, errc::aliased, "o_c", false},
  };
  run_cases(call, join(kept, aliasing), false);
}

TEST_CASE("combine_backward rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) {
    return combine_backward(a.p, a.d_o, a.gate, a.o_c, a.dgate, a.d_o_c, nullptr);
  };
  std::vector<bad_case> pair = {
      {"dgate null with a gate", [](arguments& a) { a.dgate.data = nullptr; }, errc::null_pointer, "dgate", true},
      {"dgate without a gate", [](arguments& a) { a.gate.data = nullptr; }, errc::bad_argument, "dgate", true},
  };
  std::vector<bad_case> all =
      join(problem_cases(), tensor_cases("d_o", &arguments::d_o), tensor_cases("gate", &arguments::gate),
           tensor_cases("dgate", &arguments::dgate), pointer_cases("o_c", &arguments::o_c),
           pointer_cases("d_o_c", &arguments::d_o_c), pair);
  std::vector<bad_case> kept; // the null gate/dgate cases are the pair cases above
  for (auto& c : all)
    if (c.name != "gate null" && c.name != "dgate null") kept.push_back(c);
  const std::vector<bad_case> aliasing = {
      {"d_o_c over dgate", [](arguments& a) { a.d_o_c = a.dgate.data; }, errc::aliased, "d_o_c", false},
      {"dgate over d_o", [](arguments& a) { a.dgate.data = a.d_o.data; }, errc::aliased, "dgate", true},
  };
  run_cases(call, join(kept, aliasing), false);
}

namespace {

std::vector<bad_case> linear_cases() {
  return {
      {"phi not a feature map", [](arguments& a) { a.phi = static_cast<feature_map>(3); }, errc::bad_argument, "phi",
       true},
      {"eps negative", [](arguments& a) { a.eps = -1e-6f; }, errc::bad_argument, "eps", true},
      {"eps NaN", [](arguments& a) { a.eps = std::numeric_limits<float>::quiet_NaN(); }, errc::bad_argument, "eps",
       true},
      {"order not a token order", [](arguments& a) { a.order = static_cast<token_order>(2); }, errc::bad_argument,
       "order", true},
      // Raster order: the tiled views hold the wrong number of tokens.
      {"raster order with tiled tensors", [](arguments& a) { a.order = token_order::raster; }, errc::bad_tokens, "q",
       true},
  };
}

// The state kept in the buffer at `data` (every buffer the cases place it in holds linear_state_bytes).
linear_state kept_at(const arguments& a, void* data) { return {data, linear_state_bytes(a.p)}; }

} // namespace

TEST_CASE("linear_attention_forward rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) {
    return linear_attention_forward(a.p, a.phi, a.eps, a.order, a.q, a.k, a.v, a.o, a.kept, a.workspace,
                                    a.workspace_bytes, nullptr);
  };
  // The messages name both arguments, as the pair.
  const std::vector<bad_case> aliasing = {
      {"o_l over q", [](arguments& a) { a.o.data = a.q.data; }, errc::aliased, "o_l: shares memory with q,", false},
      {"k inside o_l", [](arguments& a) { a.k.data = a.o.data; }, errc::aliased, "o_l: shares memory with k,", false},
      {"v inside o_l one token row on",
       [](arguments& a) { a.v.data = static_cast<char*>(a.o.data) + a.o.token_stride * 2; }, errc::aliased,
       "o_l: shares memory with v,", false},
      {"the state inside o_l", [](arguments& a) { a.kept = kept_at(a, a.o.data); }, errc::aliased,
       "o_l and state:", false},
      {"the state inside the workspace", [](arguments& a) { a.kept = kept_at(a, a.workspace); }, errc::aliased,
       "state and workspace:", false},
      {"q inside the workspace", [](arguments& a) { a.q.data = a.workspace; }, errc::aliased,
       "workspace: shares memory with q,", false},
  };
  run_cases(call,
            join(problem_cases(), linear_cases(), tensor_cases("q", &arguments::q), tensor_cases("k", &arguments::k),
                 tensor_cases("v", &arguments::v), tensor_cases("o_l", &arguments::o), workspace_cases(), aliasing),
            true);
}

TEST_CASE("linear_attention_backward rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) {
    return linear_attention_backward(a.p, a.phi, a.eps, a.order, a.q, a.k, a.v, a.d_o, a.dq, a.dk, a.dv, a.kept,
                                     a.workspace, a.workspace_bytes, nullptr);
  };
  const std::vector<bad_case> aliasing = {
      {"dq over d_o", [](arguments& a) { a.dq.data = a.d_o.data; }, errc::aliased, "dq: shares memory with d_o,",
       false},
      {"dk over dv", [](arguments& a) { a.dk.data = a.dv.data; }, errc::aliased, "dk and dv:", false},
      {"dv over k", [](arguments& a) { a.dv.data = a.k.data; }, errc::aliased, "dv: shares memory with k,", false},
      {"dv inside dk one token row on",
       [](arguments& a) { a.dv.data = static_cast<char*>(a.dk.data) + a.dk.token_stride * 2; }, errc::aliased,
       "dk and dv:", false},
      {"dv inside the workspace", [](arguments& a) { a.dv.data = a.workspace; }, errc::aliased,
       "dv and workspace:", false},
      // The state the backward reads, under an output.
      {"the state inside dq", [](arguments& a) { a.kept = kept_at(a, a.dq.data); }, errc::aliased,
       "dq: shares memory with state,", false},
      {"the state inside the workspace", [](arguments& a) { a.kept = kept_at(a, a.workspace); }, errc::aliased,
       "workspace: shares memory with state,", false},
  };
  run_cases(call,
            join(problem_cases(), linear_cases(), tensor_cases("q", &arguments::q), tensor_cases("k", &arguments::k),
                 tensor_cases("v", &arguments::v), tensor_cases("d_o", &arguments::d_o),
                 tensor_cases("dq", &arguments::dq), tensor_cases("dk", &arguments::dk),
                 tensor_cases("dv", &arguments::dv), workspace_cases(), aliasing),
            true);
}

namespace {

std::vector<bad_case> option_cases(int64_t n) {
  return {
      {"top_k N + 1", [n](arguments& a) { a.opt.top_k = n + 1; }, errc::bad_top_k, "top_k", false},
      {"top_k -1", [](arguments& a) { a.opt.top_k = -1; }, errc::bad_top_k, "top_k", false},
      {"sparsity 1",
       [](arguments& a) {
         a.opt = options{0, 1.0, 0.0f, {}};
       },
       errc::bad_top_k, "sparsity", false},
      {"sparsity -0.5",
       [](arguments& a) {
         a.opt = options{0, -0.5, 0.0f, {}};
       },
       errc::bad_top_k, "sparsity", false},
      {"sparsity NaN",
       [](arguments& a) {
         a.opt = options{0, std::numeric_limits<double>::quiet_NaN(), 0.0f, {}};
       },
       errc::bad_top_k, "sparsity", false},
      {"scale negative", [](arguments& a) { a.opt.scale = -1.0f; }, errc::bad_argument, "scale", true},
      {"scale NaN", [](arguments& a) { a.opt.scale = std::numeric_limits<float>::quiet_NaN(); }, errc::bad_argument,
       "scale", true},
      {"caller lists with capacity 0",
       [](arguments& a) {
         a.opt.q2k = as_const(a.idx);
         a.opt.q2k.q2k_capacity = 0;
         a.gate.data = nullptr;
         a.dgate.data = nullptr;
       },
       errc::bad_index, "q2k_capacity", true},
      {"caller lists with capacity N + 1",
       [n](arguments& a) {
         a.opt.q2k = as_const(a.idx);
         a.opt.q2k.q2k_capacity = n + 1;
         a.gate.data = nullptr;
         a.dgate.data = nullptr;
       },
       errc::bad_index, "q2k_capacity", true},
      {"caller lists with a null count",
       [](arguments& a) {
         a.opt.q2k = as_const(a.idx);
         a.opt.q2k.q2k_count = nullptr;
         a.gate.data = nullptr;
         a.dgate.data = nullptr;
       },
       errc::null_pointer, "q2k_count", true},
      {"caller lists with a gate", [](arguments& a) { a.opt.q2k = as_const(a.idx); }, errc::bad_argument, "gate", true},
      {"output_order not a token_order", [](arguments& a) { a.opt.output_order = static_cast<token_order>(7); },
       errc::bad_argument, "output_order", true},
      // o holds the tiled slots, which raster order does not take.
      {"output_order raster on tiled outputs", [](arguments& a) { a.opt.output_order = token_order::raster; },
       errc::bad_tokens, "o", true},
      {"input_order not a token_order", [](arguments& a) { a.opt.input_order = static_cast<token_order>(7); },
       errc::bad_argument, "input_order", true},
  };
}

} // namespace

TEST_CASE("forward rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) {
    const forward_io io{a.q, a.k, a.v, a.gate, a.o};
    return forward(a.p, a.opt, io, a.workspace, a.workspace_bytes, nullptr);
  };
  std::vector<bad_case> all =
      join(problem_cases(), option_cases(tiles_of_default()), tensor_cases("q", &arguments::q),
           tensor_cases("k", &arguments::k), tensor_cases("v", &arguments::v), tensor_cases("o", &arguments::o),
           tensor_cases("gate", &arguments::gate), workspace_cases(),
           std::vector<bad_case>{
               {"o over q", [](arguments& a) { a.o.data = a.q.data; }, errc::aliased, "o", true},
               {"k inside o", [](arguments& a) { a.k.data = a.o.data; }, errc::aliased, "o", true},
               {"o over the workspace", [](arguments& a) { a.o.data = a.workspace; }, errc::aliased, "state", false},
               // q holds the tiled slots, which raster order does not take.
               {"input_order raster on tiled inputs", [](arguments& a) { a.opt.input_order = token_order::raster; },
                errc::bad_tokens, "q", true},
           });
  std::vector<bad_case> kept; // a null gate is valid (g = 1)
  for (auto& c : all)
    if (c.name != "gate null") kept.push_back(c);
  run_cases(call, kept, true);
}

TEST_CASE("backward rejects bad arguments untouched", "[gpu][errors]") {
  const entry_point call = [](arguments& a) {
    const backward_io io{a.q, a.k, a.v, a.gate, a.o, a.d_o, a.dq, a.dk, a.dv, a.dgate};
    return backward(a.p, a.opt, io, a.workspace, a.workspace_bytes, nullptr);
  };
  std::vector<bad_case> pair = {
      {"dgate without a gate", [](arguments& a) { a.gate.data = nullptr; }, errc::bad_argument, "dgate", true},
      // As the reference: a gate needs its gradient (the op's combine_backward stage refuses before any launch).
      {"dgate null with a gate", [](arguments& a) { a.dgate.data = nullptr; }, errc::null_pointer, "dgate", true},
  };
  std::vector<bad_case> all =
      join(problem_cases(), option_cases(tiles_of_default()), tensor_cases("q", &arguments::q),
           tensor_cases("k", &arguments::k), tensor_cases("v", &arguments::v), tensor_cases("o", &arguments::o),
           tensor_cases("d_o", &arguments::d_o), tensor_cases("dq", &arguments::dq), tensor_cases("dk", &arguments::dk),
           tensor_cases("dv", &arguments::dv), tensor_cases("gate", &arguments::gate),
           tensor_cases("dgate", &arguments::dgate), pair, workspace_cases(),
           std::vector<bad_case>{
               {"dq over d_o", [](arguments& a) { a.dq.data = a.d_o.data; }, errc::aliased, "dq", true},
               // d_o holds the tiled slots (the backward's q, k, v and gate are tiled either way). The workspace as
               // the raster plan sizes it (d_o's tiled copy in the scratch), so that the tensors are what fails.
               {"input_order raster on a tiled d_o",
                [](arguments& a) {
                  a.opt.input_order = token_order::raster;
                  std::size_t need = 0;
                  REQUIRE(backward(a.p, a.opt, backward_io{}, nullptr, need, nullptr).is_ok());
                  REQUIRE(need <= std::size_t(8) << 20); // the workspace buffer's bytes
                  a.workspace_bytes = need;
                },
                errc::bad_tokens, "d_o", true},
               {"dk over dv", [](arguments& a) { a.dk.data = a.dv.data; }, errc::aliased, "dk and dv", false},
               {"dgate over the gate", [](arguments& a) { a.dgate.data = a.gate.data; }, errc::aliased, "dgate", true},
               {"dv over the workspace", [](arguments& a) { a.dv.data = a.workspace; }, errc::aliased, "dv", false},
           });
  std::vector<bad_case> kept; // the null gate and dgate cases are the pair cases above
  for (auto& c : all)
    if (c.name != "gate null" && c.name != "dgate null") kept.push_back(c);
  run_cases(call, kept, true);
}

// ---- NaN and Inf ---------------------------------------------------------------------------------------------

namespace {

// Every row of q2k holds `count` distinct ascending tiles in [0, n).
void check_lists_valid(const std::vector<int32_t>& q2k, const std::vector<int32_t>& count, int64_t capacity, int64_t k,
                       int64_t n) {
  int64_t bad = 0;
  for (std::size_t r = 0; r < count.size(); ++r) {
    if (count[r] != k) {
      ++bad;
      continue;
    }
    for (int64_t j = 0; j < k; ++j) {
      const int32_t t = q2k[r * static_cast<std::size_t>(capacity) + static_cast<std::size_t>(j)];
      if (t < 0 || t >= n || (j > 0 && t <= q2k[r * static_cast<std::size_t>(capacity) + j - 1])) ++bad;
    }
  }
  CHECK(bad == 0);
}

} // namespace

TEST_CASE("select_top_k ranks NaN below every number and keeps Inf", "[gpu][errors][nan]") {
  VSA_TEST_RNG(g, "select nan");
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const grid3 grid : {grid3{5, 6, 7}, grid3{16, 16, 20}, grid3{48, 48, 48}}) {
    const problem p = make_problem(grid, 1, 2, 1, 64, dtype::bf16);
    const int64_t n = tile_geometry(p.grid).num_tiles(), rows = p.batch * p.q_heads * n;
    INFO("N = " << n);
    std::vector<float> scores(static_cast<std::size_t>(rows * n));
    for (int64_t r = 0; r < rows; ++r) {
      // Row kinds: all NaN, NaN mixed with ±Inf, mostly NaN with a few numbers, ties, plain.
      const int kind = static_cast<int>(r % 5);
      for (int64_t j = 0; j < n; ++j) {
        float x = static_cast<float>(g.normal());
        const double u = g.uniform(0, 1);
        if (kind == 0) x = nan;
        if (kind == 1) x = u < 0.3 ? nan : u < 0.5 ? inf : u < 0.7 ? -inf : x;
        if (kind == 2) x = u < 0.9 ? nan : x;
        if (kind == 3) x = u < 0.5 ? 1.0f : u < 0.6 ? -inf : nan;
        scores[static_cast<std::size_t>(r * n + j)] = x;
      }
    }
    for (const int64_t k : {int64_t(1), (n + 1) / 2, n}) {
      INFO("k = " << k);
      const device_buffer d_scores = upload(scores);
      device_buffer q2k(static_cast<std::size_t>(rows * k) * 4), count(static_cast<std::size_t>(rows) * 4), ws(256);
      q2k.poison_indices();
      count.poison_indices();
      const index_lists idx{q2k.as<int32_t>(), count.as<int32_t>(), k, nullptr, nullptr};
      std::size_t bytes = 0;
      REQUIRE(select_top_k(p, k, d_scores.as<float>(), idx, nullptr, bytes, nullptr).is_ok());
      REQUIRE(bytes <= ws.bytes());
      const status s = select_top_k(p, k, d_scores.as<float>(), idx, ws.get(), bytes, nullptr);
      INFO(s.message());
      REQUIRE(s.is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      const std::vector<int32_t> got = q2k.download<int32_t>(), got_count = count.download<int32_t>();
      check_lists_valid(got, got_count, k, k, n);
      // Exactly the reference's choice (same tie and NaN rules).
      std::vector<int32_t> ref(got.size(), -1), ref_count(got_count.size(), 0);
      REQUIRE(
          reference::select_top_k(p, k, scores.data(), {ref.data(), ref_count.data(), k, nullptr, nullptr}).is_ok());
      CHECK(got == ref);
      CHECK(got_count == ref_count);
      CHECK(q2k.canaries_intact());
      CHECK(count.canaries_intact());
    }
  }
}

TEST_CASE("the whole op on NaN and Inf inputs returns valid lists", "[gpu][errors][nan]") {
  VSA_TEST_RNG(g, "op nan");
  const problem p = make_problem({9, 10, 11}, 1, 4, 2, 64, dtype::bf16);
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), tokens = geo.tiled_tokens();
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (const int pattern : {0, 1, 2}) {
    DYNAMIC_SECTION("pattern " << pattern) {
      host_tensor q(p.type, p.batch, tokens, p.q_heads, p.head_dim), k(p.type, p.batch, tokens, p.kv_heads, p.head_dim),
          v(p.type, p.batch, tokens, p.kv_heads, p.head_dim);
      fill_tiled_normal(q, p.grid, g);
      fill_tiled_normal(k, p.grid, g);
      fill_tiled_normal(v, p.grid, g);
      // 0: NaN in a few query and key tokens; 1: ±Inf in keys (means become ±Inf or NaN); 2: everything NaN.
      for (int64_t e = 0; e < q.elements(); ++e) {
        const double u = g.uniform(0, 1);
        if (pattern == 0 && u < 0.01) q.put(e, nan);
        if (pattern == 2) q.put(e, nan);
      }
      for (int64_t e = 0; e < k.elements(); ++e) {
        const double u = g.uniform(0, 1);
        if (pattern == 0 && u < 0.01) k.put(e, nan);
        if (pattern == 1 && u < 0.02) k.put(e, u < 0.01 ? inf : -inf);
        if (pattern == 2) k.put(e, nan);
      }
      const device_tensor dq(q), dk(k), dv(v);
      device_tensor o(q, poisoned);
      options opt;
      opt.top_k = 5;
      const forward_io io{dq.cview(), dk.cview(), dv.cview(), {}, o.view()};
      std::size_t bytes = 0, back_bytes = 0;
      REQUIRE(forward(p, opt, io, nullptr, bytes, nullptr).is_ok());
      REQUIRE(backward(p, opt, backward_io{}, nullptr, back_bytes, nullptr).is_ok());
      REQUIRE(back_bytes >= bytes);
      // One workspace for both: the backward reads what the forward left and needs more room after it.
      device_buffer ws(back_bytes);
      ws.poison();
      const status s = forward(p, opt, io, ws.get(), bytes, nullptr);
      INFO(s.message());
      REQUIRE(s.is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      detail::op_workspace w;
      REQUIRE(detail::plan_op(p, opt, w).is_ok());
      const int64_t rows = p.batch * p.q_heads * n;
      const std::vector<int32_t> q2k = ws.download<int32_t>(w.q2k, rows * w.capacity);
      const std::vector<int32_t> count = ws.download<int32_t>(w.q2k_count, rows);
      check_lists_valid(q2k, count, w.capacity, 5, n);
      CHECK(o.canaries_intact());
      CHECK(ws.canaries_intact());
      // The backward runs to completion on the same workspace.
      device_tensor dgrad_q(q, poisoned), dgrad_k(k, poisoned), dgrad_v(k, poisoned);
      const backward_io bio{dq.cview(),     dk.cview(),     dv.cview(),     {}, o.cview(), dq.cview(),
                            dgrad_q.view(), dgrad_k.view(), dgrad_v.view(), {}};
      std::size_t given = ws.bytes();
      const status b = backward(p, opt, bio, ws.get(), given, nullptr);
      INFO(b.message());
      CHECK(b.is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      CHECK(dgrad_q.canaries_intact());
      CHECK(dgrad_k.canaries_intact());
      CHECK(dgrad_v.canaries_intact());
    }
  }
}

// ---- every entry point on random problems, for the sanitizers ----------------------------------------------------

namespace {

struct random_problem {
  problem p;
  layout order;
  int64_t top_k;
};

random_problem draw_problem(rng& g, int index) {
  random_problem r;
  const int64_t kv = g.integer(1, 2), group = g.integer(1, 2);
  // Grids from one partial tile up to a few tiles per axis, so that full and partial tiles mix.
  r.p = make_problem({g.integer(1, 10), g.integer(1, 10), g.integer(1, 12)}, g.integer(1, 2), kv * group, kv,
                     g.integer(0, 1) ? 64 : 128, g.integer(0, 1) ? dtype::bf16 : dtype::fp16);
  r.order = index % 2 == 0 ? layout::bshd : layout::bhsd;
  const int64_t n = tile_geometry(r.p.grid).num_tiles();
  // k = 1 and k = N are both drawn regularly.
  r.top_k = index % 4 == 0 ? 1 : index % 4 == 1 ? n : g.integer(1, n);
  return r;
}

} // namespace

TEST_CASE("every entry point on random problems", "[gpu][sanitize]") {
  VSA_TEST_RNG(g, "sanitize sweep");
  constexpr int problems = 40;
  for (int index = 0; index < problems; ++index) {
    const random_problem rp = draw_problem(g, index);
    const problem& p = rp.p;
    const tile_geometry geo(p.grid);
    const int64_t n = geo.num_tiles(), tokens = geo.tiled_tokens(), dim = p.head_dim;
    const int64_t bq = p.batch * p.q_heads, bk = p.batch * p.kv_heads;
    const std::size_t e = dtype_size(p.type);
    INFO("problem " << index << ": " << p.grid.t << "x" << p.grid.h << "x" << p.grid.w << " B" << p.batch << " Hq"
                    << p.q_heads << " Hkv" << p.kv_heads << " D" << dim << " " << dtype_name(p.type)
                    << (rp.order == layout::bshd ? " bshd" : " bhsd") << " k " << rp.top_k << " N " << n);
    const float scale = 1.f / std::sqrt(static_cast<float>(dim));

    host_tensor raster(p.type, p.batch, geo.raster_tokens(), p.q_heads, dim, rp.order);
    raster.fill_normal(g);
    host_tensor kh(p.type, p.batch, tokens, p.kv_heads, dim, rp.order),
        vh = kh, gh(p.type, p.batch, tokens, p.q_heads, dim, rp.order);
    fill_tiled_normal(kh, p.grid, g);
    fill_tiled_normal(vh, p.grid, g);
    fill_tiled_normal(gh, p.grid, g);
    const device_tensor d_raster(raster), dk(kh), dv(vh), dgate_in(gh);
    const host_tensor q_shape(p.type, p.batch, tokens, p.q_heads, dim, rp.order);
    device_tensor dq(q_shape, poisoned), back(raster, poisoned);

    // Layout: tile then untile, which must give the raster tensor back.
    REQUIRE(tile(p, p.q_heads, d_raster.cview(), dq.view(), nullptr).is_ok());
    REQUIRE(untile(p, p.q_heads, dq.cview(), back.view(), nullptr).is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(back.download().bytes == raster.bytes);

    // Stages one by one.
    device_buffer q_c(bq * n * dim * e), k_c(bk * n * dim * e), v_c(bk * n * dim * e), q_c32(bq * n * dim * 4),
        k_c32(bk * n * dim * 4), o_c(bq * n * dim * e), lse_c(bq * n * 4), scores(bq * n * n * 4),
        q2k(bq * n * rp.top_k * 4), count(bq * n * 4), k2q(bq * n * rp.top_k * 4), offset(bq * (n + 1) * 4),
        lse(bq * tokens * 4);
    for (device_buffer* b : {&q_c, &k_c, &v_c, &q_c32, &k_c32, &o_c, &lse_c, &scores, &lse}) b->poison();
    for (device_buffer* b : {&q2k, &count, &k2q, &offset}) b->poison_indices();
    REQUIRE(block_means(p, dq.cview(), dk.cview(), dv.cview(), q_c.get(), k_c.get(), v_c.get(), q_c32.as<float>(),
                        k_c32.as<float>(), nullptr)
                .is_ok());
    REQUIRE(coarse_scores(p, scale, q_c32.as<float>(), k_c32.as<float>(), scores.as<float>(), nullptr).is_ok());
    REQUIRE(coarse_attention(p, scores.as<float>(), v_c.get(), o_c.get(), nullptr, lse_c.as<float>(), nullptr).is_ok());
    index_lists idx{q2k.as<int32_t>(), count.as<int32_t>(), rp.top_k, k2q.as<int32_t>(), offset.as<int32_t>()};
    std::size_t select_bytes = 0, k2q_bytes = 0;
    REQUIRE(select_top_k(p, rp.top_k, scores.as<float>(), idx, nullptr, select_bytes, nullptr).is_ok());
    device_buffer select_ws(select_bytes);
    REQUIRE(select_top_k(p, rp.top_k, scores.as<float>(), idx, select_ws.get(), select_bytes, nullptr).is_ok());
    REQUIRE(build_k2q(p, idx, nullptr, k2q_bytes, nullptr).is_ok());
    device_buffer k2q_ws(k2q_bytes);
    REQUIRE(build_k2q(p, idx, k2q_ws.get(), k2q_bytes, nullptr).is_ok());
    device_tensor o_s(q_shape, poisoned), o(q_shape, poisoned), d_o(q_shape, poisoned);
    REQUIRE(sparse_attention_forward(p, scale, dq.cview(), dk.cview(), dv.cview(), as_const(idx), o_s.view(),
                                     lse.as<float>(), nullptr)
                .is_ok());
    REQUIRE(combine(p, o_s.cview(), dgate_in.cview(), o_c.get(), o.view(), nullptr).is_ok());
    // dO: any values; use the gate's.
    VSA_REQUIRE_RT(copy_device_to_device(d_o.raw(), dgate_in.raw(), gh.bytes.size()));
    device_tensor grad_gate(q_shape, poisoned), gq(q_shape, poisoned), gk(kh, poisoned), gv(kh, poisoned);
    device_buffer d_o_c(bq * n * dim * e), dq_c(bq * n * dim * 4), dk_c(bk * n * dim * 4), dv_c(bk * n * dim * 4);
    REQUIRE(
        combine_backward(p, d_o.cview(), dgate_in.cview(), o_c.get(), grad_gate.view(), d_o_c.get(), nullptr).is_ok());
    std::size_t coarse_bytes = 0, sparse_bytes = 0;
    REQUIRE(coarse_attention_backward(p, scale, q_c.get(), k_c.get(), v_c.get(), scores.as<float>(), o_c.get(), nullptr,
                                      d_o_c.get(), lse_c.as<float>(), dq_c.as<float>(), dk_c.as<float>(),
                                      dv_c.as<float>(), nullptr, coarse_bytes, nullptr)
                .is_ok());
    device_buffer coarse_ws(coarse_bytes);
    REQUIRE(coarse_attention_backward(p, scale, q_c.get(), k_c.get(), v_c.get(), scores.as<float>(), o_c.get(), nullptr,
                                      d_o_c.get(), lse_c.as<float>(), dq_c.as<float>(), dk_c.as<float>(),
                                      dv_c.as<float>(), coarse_ws.get(), coarse_bytes, nullptr)
                .is_ok());
    REQUIRE(sparse_attention_backward(p, scale, dq.cview(), dk.cview(), dv.cview(), o_s.cview(), d_o.cview(),
                                      lse.as<float>(), as_const(idx), gq.view(), gk.view(), gv.view(), nullptr,
                                      sparse_bytes, nullptr)
                .is_ok());
    device_buffer sparse_ws(sparse_bytes);
    REQUIRE(sparse_attention_backward(p, scale, dq.cview(), dk.cview(), dv.cview(), o_s.cview(), d_o.cview(),
                                      lse.as<float>(), as_const(idx), gq.view(), gk.view(), gv.view(), sparse_ws.get(),
                                      sparse_bytes, nullptr)
                .is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(o.all_written());
    CHECK(gq.all_written());
    CHECK(gk.all_written());
    CHECK(gv.all_written());
    CHECK(grad_gate.all_written());

    // Linear attention, in tiled order (these tensors) and in raster order (the raster tensor as q, k and v).
    for (const token_order order : {token_order::tiled, token_order::raster}) {
      const feature_map phi = static_cast<feature_map>(g.integer(0, 2));
      const bool tiled = order == token_order::tiled;
      const host_tensor shape_q = tiled ? q_shape : raster;
      const host_tensor kv_shape(p.type, p.batch, tiled ? tokens : geo.raster_tokens(), p.kv_heads, dim, rp.order);
      device_tensor kk(kv_shape, poisoned), vv(kv_shape, poisoned);
      // Keys and values: the first kv heads' worth of the query tensor's bytes are fine as data.
      VSA_REQUIRE_RT(copy_device_to_device(kk.raw(), tiled ? dk.raw() : d_raster.raw(), kv_shape.bytes.size()));
      VSA_REQUIRE_RT(copy_device_to_device(vv.raw(), tiled ? dv.raw() : d_raster.raw(), kv_shape.bytes.size()));
      const const_tensor qq = tiled ? dq.cview() : d_raster.cview();
      device_tensor o_l(shape_q, poisoned), lq(shape_q, poisoned), lk(kv_shape, poisoned), lv(kv_shape, poisoned);
      std::size_t fb = 0, bb = 0;
      REQUIRE(
          linear_attention_forward(p, phi, 1e-6f, order, qq, kk.cview(), vv.cview(), o_l.view(), nullptr, fb, nullptr)
              .is_ok());
      device_buffer fws(fb);
      REQUIRE(
          linear_attention_forward(p, phi, 1e-6f, order, qq, kk.cview(), vv.cview(), o_l.view(), fws.get(), fb, nullptr)
              .is_ok());
      REQUIRE(linear_attention_backward(p, phi, 1e-6f, order, qq, kk.cview(), vv.cview(), o_l.cview(), lq.view(),
                                        lk.view(), lv.view(), nullptr, bb, nullptr)
                  .is_ok());
      device_buffer bws(bb);
      REQUIRE(linear_attention_backward(p, phi, 1e-6f, order, qq, kk.cview(), vv.cview(), o_l.cview(), lq.view(),
                                        lk.view(), lv.view(), bws.get(), bb, nullptr)
                  .is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      CHECK(o_l.all_written());
      CHECK(lq.all_written());
      CHECK(lk.all_written());
      CHECK(lv.all_written());
    }

    // The whole op, gated, forward and backward; then with the caller's lists (the ones built above).
    options opt;
    opt.top_k = rp.top_k;
    device_tensor oo(q_shape, poisoned), gq2(q_shape, poisoned), gk2(kh, poisoned), gv2(kh, poisoned),
        gg2(q_shape, poisoned);
    const forward_io fio{dq.cview(), dk.cview(), dv.cview(), dgate_in.cview(), oo.view()};
    const backward_io bio{dq.cview(),  dk.cview(), dv.cview(), dgate_in.cview(), oo.cview(),
                          d_o.cview(), gq2.view(), gk2.view(), gv2.view(),       gg2.view()};
    std::size_t f_bytes = 0, b_bytes = 0;
    REQUIRE(forward(p, opt, fio, nullptr, f_bytes, nullptr).is_ok());
    REQUIRE(backward(p, opt, bio, nullptr, b_bytes, nullptr).is_ok());
    device_buffer op_ws(std::max(f_bytes, b_bytes));
    REQUIRE(forward(p, opt, fio, op_ws.get(), f_bytes, nullptr).is_ok());
    REQUIRE(backward(p, opt, bio, op_ws.get(), b_bytes, nullptr).is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(oo.all_written());
    CHECK(gq2.all_written());
    CHECK(gk2.all_written());
    CHECK(gv2.all_written());
    CHECK(gg2.all_written());

    options given;
    given.q2k = as_const(idx);
    const forward_io fio2{dq.cview(), dk.cview(), dv.cview(), {}, oo.view()};
    const backward_io bio2{dq.cview(),  dk.cview(), dv.cview(), {},         oo.cview(),
                           d_o.cview(), gq2.view(), gk2.view(), gv2.view(), {}};
    std::size_t f2 = 0, b2 = 0;
    REQUIRE(forward(p, given, fio2, nullptr, f2, nullptr).is_ok());
    REQUIRE(backward(p, given, bio2, nullptr, b2, nullptr).is_ok());
    device_buffer op_ws2(std::max(f2, b2));
    REQUIRE(forward(p, given, fio2, op_ws2.get(), f2, nullptr).is_ok());
    REQUIRE(backward(p, given, bio2, op_ws2.get(), b2, nullptr).is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    for (const device_buffer* b :
         {&q_c,       &k_c,    &v_c,   &o_c,  &lse_c, &scores, &q2k,       &count,     &k2q,   &offset, &lse,
          &select_ws, &k2q_ws, &d_o_c, &dq_c, &dk_c,  &dv_c,   &coarse_ws, &sparse_ws, &op_ws, &op_ws2})
      CHECK(b->canaries_intact());
  }
}

} // namespace test
} // namespace vsa
