// Runs the whole Video Sparse Attention op, forward and backward, on a synthetic problem the size of one
// attention layer of Wan 2.1 1.3B at 480p (1 × 12 heads × 128 dims over a 21×30×52 latent grid, 90% of the
// key tiles skipped), with random normal inputs from a fixed seed.
//
// Built with a GPU compiler (hipcc, or nvcc through CMake) and run on a machine with a GPU, it times the op
// on the device and checks it against the CPU reference on a reduced problem. Otherwise it runs the CPU
// reference on the same grid with one head of 64 dims, 24 times less work than the whole layer (--full).
//
//   vsa_example [--cpu] [--full]   --cpu: use the CPU reference even when a GPU is present
//                                  --full: on the CPU, the whole layer (12 heads x 128 dims; slow)
#include <vsa/vsa.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define VSA_EXAMPLE_GPU 1
#endif

namespace {

// ---- problem and host data -------------------------------------------------------------------------------

struct workload {
  const char* name;
  vsa::problem p;
  vsa::options opt;
};

workload wan21_480p_gpu() {
  workload w{"wan2.1-1.3b-480p", {}, {}};
  w.p.batch = 1;
  w.p.q_heads = 12;
  w.p.kv_heads = 12;
  w.p.head_dim = 128;
  w.p.grid = {21, 30, 52};
  w.p.type = vsa::dtype::bf16;
  w.opt.sparsity = 0.9;
  return w;
}

// The CPU reference computes in double on the host: one head of 64 dims keeps it to seconds.
workload wan21_480p_cpu() {
  workload w = wan21_480p_gpu();
  w.name = "wan2.1-1.3b-480p, reduced to 1 head x 64 dims for the CPU";
  w.p.q_heads = 1;
  w.p.kv_heads = 1;
  w.p.head_dim = 64;
  return w;
}

// Host memory aligned to 256 bytes, the alignment the workspace contract asks for.
class host_buffer {
public:
  host_buffer() = default;
  explicit host_buffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ != 0) {
      data_ = ::operator new(bytes_, std::align_val_t(256));
      std::memset(data_, 0, bytes_);
    }
  }
  host_buffer(host_buffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_) {
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  host_buffer& operator=(host_buffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  host_buffer(const host_buffer&) = delete;
  host_buffer& operator=(const host_buffer&) = delete;
  ~host_buffer() {
    if (data_ != nullptr) ::operator delete(data_, std::align_val_t(256));
  }
  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Every tensor of the op, [B, S, H, D] in tiled order (S = N·64), in p.type.
struct host_tensors {
  host_buffer q, k, v, gate, d_o;   // inputs
  host_buffer o, dq, dk, dv, dgate; // outputs
};

int64_t tiled_tokens(const vsa::problem& p) { return vsa::tile_geometry(p.grid).tiled_tokens(); }

std::size_t tensor_bytes(const vsa::problem& p, int64_t heads) {
  return static_cast<std::size_t>(p.batch * tiled_tokens(p) * heads * p.head_dim) * vsa::dtype_size(p.type);
}

// Runs body(begin, end) over [0, count) on every hardware thread.
template <class Body> void parallel_for(int64_t count, const Body& body) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), count));
  std::vector<std::thread> pool;
  const int64_t chunk = (count + threads - 1) / threads;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t begin = t * chunk, end = std::min(count, begin + chunk);
    if (begin < end) pool.emplace_back([&body, begin, end] { body(begin, end); });
  }
  for (std::thread& t : pool) t.join();
}

// A standard normal sample that depends only on (seed, index), so filling in parallel stays reproducible.
float normal_sample(uint64_t seed, uint64_t index) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + index;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  const double u1 = (static_cast<double>(x >> 40) + 0.5) / 16777216.0;
  const double u2 = (static_cast<double>(x & 0xffffffu) + 0.5) / 16777216.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

// Random normal values in the valid slots, zeros in the padding slots, as vsa's tile step leaves them.
host_buffer random_tensor(const vsa::problem& p, int64_t heads, uint64_t seed) {
  host_buffer buffer(tensor_bytes(p, heads));
  const vsa::tile_geometry geometry(p.grid);
  const int64_t tokens = geometry.tiled_tokens(), row = heads * p.head_dim;
  void* data = buffer.data();
  parallel_for(p.batch * tokens, [&](int64_t begin, int64_t end) {
    for (int64_t bs = begin; bs < end; ++bs) {
      const int64_t slot = bs % tokens;
      if (slot % vsa::tile_tokens >= geometry.valid(slot / vsa::tile_tokens)) continue;
      for (int64_t e = bs * row; e < (bs + 1) * row; ++e)
        vsa::store(data, e, normal_sample(seed, static_cast<uint64_t>(e)), p.type);
    }
  });
  return buffer;
}

host_tensors make_tensors(const vsa::problem& p) {
  host_tensors t;
  t.q = random_tensor(p, p.q_heads, 1);
  t.k = random_tensor(p, p.kv_heads, 2);
  t.v = random_tensor(p, p.kv_heads, 3);
  t.gate = random_tensor(p, p.q_heads, 4);
  t.d_o = random_tensor(p, p.q_heads, 5);
  t.o = host_buffer(tensor_bytes(p, p.q_heads));
  t.dq = host_buffer(tensor_bytes(p, p.q_heads));
  t.dk = host_buffer(tensor_bytes(p, p.kv_heads));
  t.dv = host_buffer(tensor_bytes(p, p.kv_heads));
  t.dgate = host_buffer(tensor_bytes(p, p.q_heads));
  return t;
}

// The views of the op's arguments over a set of buffers (host or device pointers alike).
struct pointers {
  const void *q, *k, *v, *gate, *d_o;
  void *o, *dq, *dk, *dv, *dgate;
};

vsa::forward_io forward_views(const vsa::problem& p, const pointers& x) {
  const int64_t s = tiled_tokens(p), b = p.batch, d = p.head_dim;
  vsa::forward_io io;
  io.q = vsa::bshd(x.q, b, s, p.q_heads, d);
  io.k = vsa::bshd(x.k, b, s, p.kv_heads, d);
  io.v = vsa::bshd(x.v, b, s, p.kv_heads, d);
  io.gate = vsa::bshd(x.gate, b, s, p.q_heads, d);
  io.o = vsa::bshd(x.o, b, s, p.q_heads, d);
  return io;
}

vsa::backward_io backward_views(const vsa::problem& p, const pointers& x) {
  const int64_t s = tiled_tokens(p), b = p.batch, d = p.head_dim;
  vsa::backward_io io;
  io.q = vsa::bshd(x.q, b, s, p.q_heads, d);
  io.k = vsa::bshd(x.k, b, s, p.kv_heads, d);
  io.v = vsa::bshd(x.v, b, s, p.kv_heads, d);
  io.gate = vsa::bshd(x.gate, b, s, p.q_heads, d);
  io.o = vsa::bshd(static_cast<const void*>(x.o), b, s, p.q_heads, d);
  io.d_o = vsa::bshd(x.d_o, b, s, p.q_heads, d);
  io.dq = vsa::bshd(x.dq, b, s, p.q_heads, d);
  io.dk = vsa::bshd(x.dk, b, s, p.kv_heads, d);
  io.dv = vsa::bshd(x.dv, b, s, p.kv_heads, d);
  io.dgate = vsa::bshd(x.dgate, b, s, p.q_heads, d);
  return io;
}

pointers host_pointers(host_tensors& t) {
  return {t.q.data(), t.k.data(),  t.v.data(),  t.gate.data(), t.d_o.data(),
          t.o.data(), t.dq.data(), t.dk.data(), t.dv.data(),   t.dgate.data()};
}

// ---- results -----------------------------------------------------------------------------------------------

double checksum(const host_buffer& x, vsa::dtype t) {
  const int64_t n = static_cast<int64_t>(x.bytes() / vsa::dtype_size(t));
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += vsa::load(x.data(), i, t);
  return sum;
}

void print_problem(const char* where, const workload& w) {
  const vsa::tile_geometry g(w.p.grid);
  std::printf("%s\n", where);
  std::printf("problem  %s: batch %lld, heads %lld/%lld (q/kv), head dim %lld, %s, grid %lldx%lldx%lld\n", w.name,
              (long long)w.p.batch, (long long)w.p.q_heads, (long long)w.p.kv_heads, (long long)w.p.head_dim,
              vsa::dtype_name(w.p.type), (long long)w.p.grid.t, (long long)w.p.grid.h, (long long)w.p.grid.w);
  std::printf("tiles    %lld (%lldx%lldx%lld), %lld tiled tokens, k = %lld key tiles per query tile (sparsity %.2f)\n",
              (long long)g.num_tiles(), (long long)g.tiles.t, (long long)g.tiles.h, (long long)g.tiles.w,
              (long long)g.tiled_tokens(), (long long)vsa::resolve_top_k(g.num_tiles(), w.opt), w.opt.sparsity);
}

void print_checksums(const vsa::problem& p, const host_tensors& t) {
  std::printf("checksum o %.6e, dq %.6e, dk %.6e, dv %.6e, dgate %.6e\n", checksum(t.o, p.type), checksum(t.dq, p.type),
              checksum(t.dk, p.type), checksum(t.dv, p.type), checksum(t.dgate, p.type));
}

bool report(const char* what, const vsa::status& s) {
  if (!s) std::fprintf(stderr, "error: %s: %s (%s)\n", what, s.message(), vsa::errc_name(s.code()));
  return s.is_ok();
}

// ---- CPU reference ------------------------------------------------------------------------------------------

struct cpu_times {
  double forward_ms = 0, backward_ms = 0;
};

bool run_cpu(const workload& w, host_tensors& t, cpu_times* times) {
  const pointers x = host_pointers(t);
  const vsa::forward_io fio = forward_views(w.p, x);
  const vsa::backward_io bio = backward_views(w.p, x);
  // Two-phase workspace: ask both passes, allocate once; the backward reads what the forward left there.
  std::size_t forward_bytes = 0, backward_bytes = 0;
  if (!report("reference::forward (size query)", vsa::reference::forward(w.p, w.opt, fio, nullptr, forward_bytes)) ||
      !report("reference::backward (size query)", vsa::reference::backward(w.p, w.opt, bio, nullptr, backward_bytes)))
    return false;
  host_buffer workspace(std::max(forward_bytes, backward_bytes));
  std::size_t bytes = workspace.bytes();

  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  if (!report("reference::forward", vsa::reference::forward(w.p, w.opt, fio, workspace.data(), bytes))) return false;
  const auto t1 = clock::now();
  if (!report("reference::backward", vsa::reference::backward(w.p, w.opt, bio, workspace.data(), bytes))) return false;
  const auto t2 = clock::now();
  if (times != nullptr) {
    times->forward_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    times->backward_ms = std::chrono::duration<double, std::milli>(t2 - t1).count();
  }
  return true;
}

int main_cpu(const char* why, bool full) {
  const workload w = full ? wan21_480p_gpu() : wan21_480p_cpu();
  if (full) std::printf("note     the whole layer on the CPU reference, in double: this takes many minutes\n");
  char where[160];
  std::snprintf(where, sizeof(where), "device   CPU reference (%s; %u threads)", why,
                std::thread::hardware_concurrency());
  print_problem(where, w);
  host_tensors t = make_tensors(w.p);
  cpu_times times;
  if (!run_cpu(w, t, &times)) return 1;
  std::printf("time     forward %.1f ms, backward %.1f ms (CPU reference, double accumulation)\n", times.forward_ms,
              times.backward_ms);
  print_checksums(w.p, t);
  return 0;
}

// ---- GPU ----------------------------------------------------------------------------------------------------

#if VSA_EXAMPLE_GPU

#if VSA_RUNTIME_HIP
#define VSA_EX_RT(name) hip##name
using device_properties = hipDeviceProp_t;
#else
#define VSA_EX_RT(name) cuda##name
using device_properties = cudaDeviceProp;
#endif

// Small enough for the CPU reference, with grouped heads and partial tiles, to check the GPU against.
workload reduced_problem() {
  workload w{"a reduced problem", {}, {}};
  w.p.batch = 1;
  w.p.q_heads = 2;
  w.p.kv_heads = 1;
  w.p.head_dim = 128;
  w.p.grid = {8, 12, 14};
  w.p.type = vsa::dtype::bf16;
  w.opt.sparsity = 0.9;
  return w;
}

// ||a - b|| / ||b|| over whole tensors; NaN anywhere makes it NaN, which the caller treats as a failure.
double relative_error(const host_buffer& a, const host_buffer& b, vsa::dtype t) {
  const int64_t n = static_cast<int64_t>(b.bytes() / vsa::dtype_size(t));
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = vsa::load(a.data(), i, t), y = vsa::load(b.data(), i, t);
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

bool check_runtime(vsa::gpu::error_t e, const char* what) { return report(what, vsa::gpu::runtime_status(e, what)); }

class device_buffer {
public:
  device_buffer() = default;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() {
    if (data_ != nullptr) (void)VSA_EX_RT(Free)(data_);
  }
  // The runtime's allocations are aligned far beyond the 256 bytes the op asks for.
  bool allocate(std::size_t bytes) {
    bytes_ = bytes;
    return bytes == 0 || check_runtime(VSA_EX_RT(Malloc)(&data_, bytes), "device allocation");
  }
  bool upload(const host_buffer& h) {
    return allocate(h.bytes()) &&
           check_runtime(VSA_EX_RT(Memcpy)(data_, h.data(), h.bytes(), VSA_EX_RT(MemcpyHostToDevice)), "upload");
  }
  bool download(host_buffer& h) const {
    return check_runtime(VSA_EX_RT(Memcpy)(h.data(), data_, h.bytes(), VSA_EX_RT(MemcpyDeviceToHost)), "download");
  }
  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

class device_event {
public:
  device_event() { ok_ = check_runtime(VSA_EX_RT(EventCreate)(&event_), "event create"); }
  device_event(const device_event&) = delete;
  device_event& operator=(const device_event&) = delete;
  ~device_event() {
    if (ok_) (void)VSA_EX_RT(EventDestroy)(event_);
  }
  bool ok() const { return ok_; }
  VSA_EX_RT(Event_t) get() const { return event_; }

private:
  VSA_EX_RT(Event_t) event_{};
  bool ok_ = false;
};

struct device_tensors {
  device_buffer q, k, v, gate, d_o, o, dq, dk, dv, dgate;
  pointers views() const {
    return {q.data(), k.data(),  v.data(),  gate.data(), d_o.data(),
            o.data(), dq.data(), dk.data(), dv.data(),   dgate.data()};
  }
};

struct gpu_times {
  double forward_ms = 0, backward_ms = 0;
  int iterations = 0;
};

// Uploads the inputs, runs forward and backward `iterations` times after one warm-up (each pass timed with
// events on the stream), and downloads the outputs of the last iteration.
bool run_gpu(const workload& w, host_tensors& t, int iterations, gpu_times* times) {
  device_tensors d;
  if (!d.q.upload(t.q) || !d.k.upload(t.k) || !d.v.upload(t.v) || !d.gate.upload(t.gate) || !d.d_o.upload(t.d_o) ||
      !d.o.allocate(t.o.bytes()) || !d.dq.allocate(t.dq.bytes()) || !d.dk.allocate(t.dk.bytes()) ||
      !d.dv.allocate(t.dv.bytes()) || !d.dgate.allocate(t.dgate.bytes()))
    return false;
  const pointers x = d.views();
  const vsa::forward_io fio = forward_views(w.p, x);
  const vsa::backward_io bio = backward_views(w.p, x);

  vsa::gpu::stream_t stream{};
  if (!check_runtime(VSA_EX_RT(StreamCreate)(&stream), "stream create")) return false;
  struct stream_guard {
    vsa::gpu::stream_t s;
    ~stream_guard() { (void)VSA_EX_RT(StreamDestroy)(s); }
  } guard{stream};

  std::size_t forward_bytes = 0, backward_bytes = 0;
  if (!report("forward (size query)", vsa::forward(w.p, w.opt, fio, nullptr, forward_bytes, stream)) ||
      !report("backward (size query)", vsa::backward(w.p, w.opt, bio, nullptr, backward_bytes, stream)))
    return false;
  device_buffer workspace;
  if (!workspace.allocate(std::max(forward_bytes, backward_bytes))) return false;
  std::size_t bytes = workspace.bytes();

  device_event start, mid, stop;
  if (!start.ok() || !mid.ok() || !stop.ok()) return false;
  double forward_ms = 0, backward_ms = 0;
  for (int it = -1; it < iterations; ++it) { // iteration -1 warms up and is not timed
    if (!check_runtime(VSA_EX_RT(EventRecord)(start.get(), stream), "event record") ||
        !report("forward", vsa::forward(w.p, w.opt, fio, workspace.data(), bytes, stream)) ||
        !check_runtime(VSA_EX_RT(EventRecord)(mid.get(), stream), "event record") ||
        !report("backward", vsa::backward(w.p, w.opt, bio, workspace.data(), bytes, stream)) ||
        !check_runtime(VSA_EX_RT(EventRecord)(stop.get(), stream), "event record") ||
        !check_runtime(VSA_EX_RT(EventSynchronize)(stop.get()), "synchronize"))
      return false;
    float f = 0, b = 0;
    if (!check_runtime(VSA_EX_RT(EventElapsedTime)(&f, start.get(), mid.get()), "event time") ||
        !check_runtime(VSA_EX_RT(EventElapsedTime)(&b, mid.get(), stop.get()), "event time"))
      return false;
    if (it >= 0) {
      forward_ms += f;
      backward_ms += b;
    }
  }
  if (times != nullptr) {
    times->iterations = iterations;
    times->forward_ms = iterations > 0 ? forward_ms / iterations : 0.0;
    times->backward_ms = iterations > 0 ? backward_ms / iterations : 0.0;
  }
  return d.o.download(t.o) && d.dq.download(t.dq) && d.dk.download(t.dk) && d.dv.download(t.dv) &&
         d.dgate.download(t.dgate);
}

// Runs the reduced problem on both sides. bf16 storage of the outputs alone gives ~4e-3; a wrong kernel gives
// O(1). A tile whose coarse score ties with another's may be selected differently on the two sides, which
// moves a few rows, hence the loose bound.
bool compare_with_reference() {
  const workload w = reduced_problem();
  host_tensors gpu = make_tensors(w.p), cpu = make_tensors(w.p);
  if (!run_gpu(w, gpu, 0, nullptr) || !run_cpu(w, cpu, nullptr)) return false;
  const double bound = 5e-2;
  bool ok = true;
  std::printf("check    GPU vs CPU reference on %s (batch %lld, heads %lld/%lld, dim %lld, grid %lldx%lldx%lld), "
              "relative L2 error:\n        ",
              w.name, (long long)w.p.batch, (long long)w.p.q_heads, (long long)w.p.kv_heads, (long long)w.p.head_dim,
              (long long)w.p.grid.t, (long long)w.p.grid.h, (long long)w.p.grid.w);
  const struct {
    const char* name;
    const host_buffer *a, *b;
  } outputs[] = {{"o", &gpu.o, &cpu.o},
                 {"dq", &gpu.dq, &cpu.dq},
                 {"dk", &gpu.dk, &cpu.dk},
                 {"dv", &gpu.dv, &cpu.dv},
                 {"dgate", &gpu.dgate, &cpu.dgate}};
  for (const auto& out : outputs) {
    const double e = relative_error(*out.a, *out.b, w.p.type);
    const bool good = e <= bound; // false for NaN too
    ok = ok && good;
    std::printf(" %s %.2e%s", out.name, e, good ? "" : " (TOO LARGE)");
  }
  std::printf("\n");
  if (!ok) std::fprintf(stderr, "error: the GPU results differ from the CPU reference by more than %.0e\n", bound);
  return ok;
}

int main_gpu(int device) {
  device_properties props{};
  if (!check_runtime(VSA_EX_RT(GetDeviceProperties)(&props, device), "device properties")) return 1;
  const workload w = wan21_480p_gpu();
  char where[300];
  std::snprintf(where, sizeof(where), "device   GPU %d: %s", device, props.name);
  print_problem(where, w);
  host_tensors t = make_tensors(w.p);
  gpu_times times;
  if (!run_gpu(w, t, 10, &times)) return 1;
  std::printf("time     forward %.3f ms, backward %.3f ms (mean of %d after a warm-up)\n", times.forward_ms,
              times.backward_ms, times.iterations);
  print_checksums(w.p, t);
  return compare_with_reference() ? 0 : 1;
}

#endif // VSA_EXAMPLE_GPU

} // namespace

int main(int argc, char** argv) {
  bool force_cpu = false, full = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--cpu") == 0) {
      force_cpu = true;
    } else if (std::strcmp(argv[i], "--full") == 0) {
      full = true;
    } else {
      std::fprintf(stderr, "usage: %s [--cpu] [--full]\n", argv[0]);
      return 2;
    }
  }
#if VSA_EXAMPLE_GPU
  if (force_cpu) return main_cpu("--cpu given", full);
  int count = 0;
  if (VSA_EX_RT(GetDeviceCount)(&count) != vsa::gpu::success || count == 0) {
    (void)vsa::gpu::last_error(); // clear the runtime's sticky "no device" error
    return main_cpu("no GPU found", full);
  }
  int device = 0;
  if (!check_runtime(vsa::gpu::current_device(&device), "current device")) return 1;
  return main_gpu(device);
#else
  (void)force_cpu;
  return main_cpu("built without a GPU compiler", full);
#endif
}
