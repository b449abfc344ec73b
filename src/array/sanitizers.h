/* Internal: which sanitizer a translation unit is built under, for GCC (__SANITIZE_ADDRESS__,
 * __SANITIZE_THREAD__) and Clang (__has_feature; clang 14 defines neither macro under
 * -fsanitize=address). Macros only, so C files may include it too. */
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define KVSNAP_ADDRESS_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVSNAP_ADDRESS_SANITIZER 1
#endif
#endif

#if defined(__SANITIZE_THREAD__)
#define KVSNAP_THREAD_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVSNAP_THREAD_SANITIZER 1
#endif
#endif
