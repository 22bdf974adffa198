# cmake -DIN=file -DOUT=header -DNAME=symbol -P embed.cmake
# Writes the file's bytes as a NUL-terminated C array.
file(READ ${IN} hex HEX)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
file(WRITE ${OUT} "/* generated from ${IN} */\nstatic const char ${NAME}[] = {${body}0x00};\n")
