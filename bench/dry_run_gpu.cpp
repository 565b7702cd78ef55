// What the autograd engine asks of CUDA, answered for GPUs that are not there (dry_run.py).
//
// A fake CUDA tensor holds no data, but autograd still asks the CUDA runtime about streams and contexts. For the
// rehearsal this registers a do-nothing CUDA device guard for `count` devices and makes the CUDA hooks say "built, no
// context yet", so autograd stashes no streams; torch cannot replace hooks it made, so the hooks object's class
// (its vtable pointer) is swapped, and restored on removal.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {

constexpr auto kCUDA = c10::DeviceType::CUDA;

struct NoGPUGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceIndex count = 1;
  c10::DeviceType type() const override { return kCUDA; }
  c10::Device exchangeDevice(c10::Device) const override { return {kCUDA, 0}; }
  c10::Device getDevice() const override { return {kCUDA, 0}; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return count; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
};

struct NoGPUHooks final : at::CUDAHooksInterface {
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return false; }
};

NoGPUGuard guard;
const NoGPUHooks hooks;
const c10::impl::DeviceGuardImplInterface* saved_guard = nullptr;
void* saved_class = nullptr;

void*& class_of(const void* object) { return *static_cast<void**>(const_cast<void*>(object)); }

}  // namespace

extern "C" void dry_run_gpu_install(int count) {
  guard.count = static_cast<c10::DeviceIndex>(count);
  saved_guard = c10::impl::device_guard_impl_registry[static_cast<size_t>(kCUDA)].exchange(&guard);
  void*& live = class_of(&at::detail::getCUDAHooks());
  saved_class = live;
  live = class_of(&hooks);
}

extern "C" void dry_run_gpu_remove() {
  class_of(&at::detail::getCUDAHooks()) = saved_class;
  c10::impl::device_guard_impl_registry[static_cast<size_t>(kCUDA)].store(saved_guard);
}

extern "C" int dry_run_gpu_installed() {  // whether the guard or the hooks are this library's now (tests)
  return c10::impl::device_guard_impl_registry[static_cast<size_t>(kCUDA)].load() == &guard ||
         class_of(&at::detail::getCUDAHooks()) == class_of(&hooks);
}
