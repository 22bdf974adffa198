/* tshare/version.h - the library's version, its ABI rule, and TSHARE_API.
 *
 * Versions follow semantic versioning. The ABI rule: within one major
 * version a newer library runs programs built against an older one (no
 * public function, struct field, enum value or macro changes meaning, size
 * or position; new ones are only added, options structs only grow at the
 * end and are filled by their *_init functions). While the major version is
 * 0, the minor version plays that role: libtshare.so.0.MINOR is the SONAME,
 * so a program never loads a library of another 0.MINOR. The wire format has
 * its own version and rule (wire.h); peers of other library versions talk as
 * long as their wire majors match.
 *
 * tshare_version() says which library is loaded, TSHARE_VERSION_* which one
 * a program was compiled against. */
#ifndef TSHARE_VERSION_H
#define TSHARE_VERSION_H

#define TSHARE_VERSION_MAJOR 0
#define TSHARE_VERSION_MINOR 2
#define TSHARE_VERSION_PATCH 0
/* One number that grows with every release: 10000 * major + 100 * minor + patch. */
#define TSHARE_VERSION_NUMBER (TSHARE_VERSION_MAJOR * 10000 + TSHARE_VERSION_MINOR * 100 + TSHARE_VERSION_PATCH)

/* Marks the public API: the shared library is built with hidden visibility,
 * so only what carries this mark is exported. */
#ifndef TSHARE_API
#if defined(__GNUC__) || defined(__clang__)
#define TSHARE_API __attribute__((visibility("default")))
#else
#define TSHARE_API
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The loaded library's version, "MAJOR.MINOR.PATCH"; never NULL. */
TSHARE_API const char *tshare_version(void);
/* The same as TSHARE_VERSION_NUMBER computes it. */
TSHARE_API int tshare_version_number(void);

#ifdef __cplusplus
}
#endif
#endif /* TSHARE_VERSION_H */
