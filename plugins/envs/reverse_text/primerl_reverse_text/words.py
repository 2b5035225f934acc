"""Word lists of reverse-text (plain data: importing this module is free).

* ``BASIC``: the 68 words of the quick start; train and eval tasks draw from all of them.
* ``ENGLISH``: about 600 common English words of 3 to 9 letters. Every fifth word (by its
  place in the sorted list) is kept for the eval split only, so a model is scored on words
  it never reversed in training: what it learned is reversing, not the answers.
"""

BASIC = ["apple", "river", "stone", "cloud", "green", "light", "north", "quiet", "swift", "table", "water", "yellow", "amber", "brick", "candle", "dance", "eagle", "flame", "grape", "honey", "island", "jelly", "kite", "lemon", "maple", "night", "ocean", "pearl", "queen", "robin", "sugar", "tiger", "umbra", "violet", "wheat", "xenon", "yacht", "zebra", "bread", "chair", "dream", "field", "glass", "heart", "juice", "knife", "lunch", "music", "noble", "olive", "piano", "quilt", "radio", "salt", "train", "unity", "voice", "whale", "young", "zone", "moon", "star", "sun", "rain", "snow", "wind", "leaf"]

_ENGLISH = """
able about above accept across act add address admit adult affect after again age agent agree ahead air
all allow almost alone along already also always among amount animal answer anyone appear apply area argue
arm army around arrive art article artist ask attack author avoid away baby back bad bag ball bank bar base
basket beach bear beat beauty become bed before begin behind believe bell below best better between beyond
big bill bird birth black blade blank blood blue board boat body bone book border born both bottle bottom
box boy brain branch brave bread break bridge bright bring broad brother brown budget build burn business
busy buy cabin cake call calm camera camp can candy capital captain car card care carry case castle cat
catch cause cell center chain chair chance change charge cheap check cheese chest chicken chief child
choice choose church circle citizen city claim class clean clear clever climb clock close cloth coach coast
coat coffee cold collect color column come common cook cool copper corn corner cost cotton could count
country couple course court cover cow crazy cream create credit crew crime crop cross crowd crown cup
current curtain cycle dad daily damage dark data daughter day dead deal dear death debate decade decide deep
defense degree delay deliver demand deny depend design desk detail device diamond dinner direct dirt
discover dish doctor dog dollar door double doubt down dozen draft dragon drama draw dress drink drive drop
drum dry duck during dust duty each eager early earn earth east easy eat edge effect effort egg eight
either elbow else empty end enemy energy engine enjoy enough enter entire equal escape even evening event
ever every exact exam example exist expect expert explain eye face fact factor fail fair faith fall false
family famous fan far farm fast father fault fear feather feel fence few field fight figure fill film final
find fine finger finish fire firm first fish five flag flat flight floor flower fly focus follow food foot
force forest forget fork form fortune forward four frame free fresh friend front fruit fuel full fun future
gain game garden gas gate gather general gentle gift girl give glad global glove goal gold good govern
grain grass great green ground group grow guard guess guest guide guitar habit hair half hall hammer hand
happen happy harbor hard hat have head health hear heavy height hello help hero hidden high hill history hit
hold hole holiday home honest hope horse hospital host hot hotel hour house huge human humor hundred hunt
hurry husband ice idea image impact income index inside insect iron island item jacket job join joke
journey judge jump jungle just keep kettle key kick kind king kitchen knee know label lady lake lamp land
language large last late laugh law lawyer layer lazy lead learn leave left leg legal lesson letter level
library life lift like limit line lion list listen little live local lock long look lose loud love low
lucky machine magic mail main major make manage many map market marry master match matter meal measure meat
medal meet member memory mention menu message metal method middle might mile milk mind minute mirror miss
mix model modern moment money monkey month more morning most mother motor mountain mouse mouth move movie
much muscle museum must name nation nature near neck need needle network never news next nice night noise
none normal north nose note nothing notice novel number nurse object ocean offer office often oil old
once only open opera orange order other outside oven over owner page paint pair palace panel paper parent
park part party pass past path patient pattern pay peace pen pencil people pepper perfect period person
phone photo piano pick picture piece pilot pink pipe place plain plan planet plant plate play please pocket
poem point police pool poor popular position post potato pound powder power practice praise prepare
present press pretty price pride print prison private prize problem process produce profit program project
proof proper protect proud public pull pupil purple push put queen question quick quiet rabbit race radio
rail raise random range rapid rare rather reach read ready real reason record red reduce region remain
remember remove repair repeat reply report rescue rest result return rich ride right ring rise risk road
rock rocket role roof room root rope rose rough round route row royal rubber rule run safe sail salad salt
same sample sand save scale scene school science score screen sea search season seat second secret section
see seed seek sell send sense series serve set settle seven shade shadow shape share sharp sheep sheet shelf
shell shift shine ship shirt shoe shoot shop short shoulder show shut side sign signal silent silver simple
since sing single sister sit six size skill skin sky sleep slice slow small smart smile smoke smooth snake
soap soft soil soldier solid solve some song soon sort sound soup south space speak special speed spend
spice spirit split sport spread spring square stable staff stage stair stamp stand start state station stay
steam steel step stick still stock stomach store storm story stove straight strange street strong student
study style subject sugar suit summer supply support sure surface sweet swim system table tail take talent
talk tall taste teach team tell temple ten tennis term test thank theory thick thin thing think third
thirty though thread three throat through throw thumb ticket tidy time tiny title today together tomato
tone tongue tonight tool tooth top topic total touch tough tour tower town toy track trade traffic train
travel tree trial trick trip truck true trust truth try tunnel turn twelve twenty twice type uncle under
unit until upper urban useful usual valley value van vast vehicle very video view village visit voice
volume vote wage wait walk wall want warm wash waste watch water wave way weak wealth wear weather wedding
week weight welcome west wet wheel when where white whole wide wife wild will win window wine winter wire
wise wish woman wonder wood word work world worry write wrong yard year yellow young youth zero zone
"""
ENGLISH = sorted(set(_ENGLISH.split()))
ENGLISH_EVAL = ENGLISH[::5]  # never drawn for training
ENGLISH_TRAIN = [w for i, w in enumerate(ENGLISH) if i % 5]
