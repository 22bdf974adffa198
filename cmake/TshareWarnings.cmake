# Warnings for tshare's own targets (never exported to users of the package).
add_library(tshare_warnings INTERFACE)
target_compile_options(tshare_warnings INTERFACE
  -Wall -Wextra -Wshadow -Wconversion -Wpointer-arith -Wformat=2 -Wundef -Wvla
  $<$<COMPILE_LANGUAGE:C>:-Wstrict-prototypes -Wmissing-prototypes>)
if(TSHARE_WERROR)
  target_compile_options(tshare_warnings INTERFACE -Werror)
endif()

if(TSHARE_SANITIZE)
  add_compile_options(-fsanitize=${TSHARE_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_link_options(-fsanitize=${TSHARE_SANITIZE})
endif()
