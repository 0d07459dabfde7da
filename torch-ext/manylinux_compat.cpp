// Keeps the extension loadable on manylinux_2_28 systems (glibc 2.28, libstdc++ of GCC 8,
// GLIBCXX_3.4.25), the hub's baseline, when it is built with a newer toolchain (Debian 12: glibc
// 2.36, GCC 12). A newer toolchain's headers make inline code reference a few symbols that only
// newer runtimes export; each one below has an equivalent that the baseline runtime does export,
// and torch-ext/CMakeLists.txt links the extension with --defsym=<new symbol>=<function here>, so
// the reference is bound inside the extension and never imported. `make test` checks every .so
// against manylinux_2_28 (scripts/check_abi.py), so a new toolchain that references another such
// symbol fails there, not on a user's machine.
//
// The functions have C linkage and the calling convention of the member functions they stand in
// for (the object pointer first; a returned std::string through the hidden result pointer).
#include <sstream>
#include <string>

// libstdc++'s basic_stringbuf<char>::str() const, as exported since GLIBCXX_3.4.21 (C++20 headers
// declare the ref-qualified overloads instead, so it is named by its symbol).
std::string scatter_add_stringbuf_str_3_4_21(const std::stringbuf* self) __asm__(
    "_ZNKSt7__cxx1115basic_stringbufIcSt11char_traitsIcESaIcEE3strEv");

// glibc 2.29 gave exp a new symbol version (the same function without the old SVID error
// handling); the original version is still exported by every glibc.
extern "C" double scatter_add_exp_glibc_2_2_5(double);
#if defined(__x86_64__)
__asm__(".symver scatter_add_exp_glibc_2_2_5,exp@GLIBC_2.2.5");
#elif defined(__aarch64__)
__asm__(".symver scatter_add_exp_glibc_2_2_5,exp@GLIBC_2.17");
#endif

extern "C" {

// glibc 2.32's __libc_single_threaded: libstdc++'s inline reference counting (std::shared_ptr,
// which torch::stable::Tensor holds) skips atomic instructions when it is non-zero. Always 0 here,
// so every count update is atomic: always correct, as with a glibc older than 2.32.
__attribute__((used)) char scatter_add_never_single_threaded = 0;

// basic_ostringstream<char>() and basic_stringstream<char>() (GLIBCXX_3.4.26): the same as the
// constructors with an explicit open mode (GLIBCXX_3.4.21), which is how libstdc++ defines them.
__attribute__((used)) void scatter_add_ostringstream_construct(void* self) {
  new (self) std::ostringstream(std::ios_base::out);
}
__attribute__((used)) void scatter_add_stringstream_construct(void* self) {
  new (self) std::stringstream(std::ios_base::in | std::ios_base::out);
}

// basic_stringbuf<char>::str() const& and str() && (GLIBCXX_3.4.29): a copy of the contents, as
// str() const returns. (str() && may leave the buffer empty; callers never read it again.)
__attribute__((used)) std::string scatter_add_stringbuf_str(const std::stringbuf* self) {
  return scatter_add_stringbuf_str_3_4_21(self);
}

// exp (GLIBC_2.29): the original version, for the core's cost model.
__attribute__((used)) double scatter_add_exp(double x) { return scatter_add_exp_glibc_2_2_5(x); }

}  // extern "C"
